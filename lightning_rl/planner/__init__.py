"""The capacity planner (`lightning-rl plan`): memory per GPU and step time of a recipe on a cluster, from model configs shipped as package data."""
