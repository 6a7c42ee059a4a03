"""docs/recipe_reference.md is what the recipe schema says today: regenerated and compared."""

from lightning_rl import recipe_reference


def test_the_recipe_reference_is_up_to_date(capsys):
    assert recipe_reference.main(["--check"]) == 0, capsys.readouterr().err
    text = recipe_reference.OUTPUT.read_text()
    for key in ("`model.loss.loss_type`", "`model.num_iterations`", "`model.dynamic_sampling`", "`data.max_tokens`",
                "`logger.kind`", "`checkpoint_every_n_steps`", "`model.lora.r`", "`model.rewards[].weight`"):  # fmt: skip
        assert key in text
    assert "|  |" not in text, "every key has its docstring"
    # A list default is shown as a recipe writes it (a TRL user mapping adam_beta1/adam_beta2 needs the number).
    assert "| `model.betas` | `tuple[float, float]` | `[0.9, 0.95]` |" in text
