"""What tests share: paths, tiny models, helper runs and worker scripts. No test module imports another."""
