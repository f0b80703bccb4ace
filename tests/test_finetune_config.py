"""Config tree: typos and bad values fail with a pointer to the fix; examples and recipes parse."""

from pathlib import Path

import pytest

from finetune.config import ConfigError, build_config, load_config, parse_override
from finetune.recipes import RECIPES

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
MINIMAL = {"data": {"path": "some/folder"}}


def test_unknown_key_names_the_path_and_suggests_the_fix():
    with pytest.raises(ConfigError, match=r"unknown config key 'optimizer.learnig_rate'; did you mean 'optimizer.learning_rate'"):
        build_config({**MINIMAL, "optimizer": {"learnig_rate": 1e-4}})
    with pytest.raises(ConfigError, match=r"'trainig'; did you mean 'training'"):
        build_config({**MINIMAL, "trainig": {}})


def test_wrong_types_and_choices_are_rejected():
    with pytest.raises(ConfigError, match=r"training.max_steps: expected an integer"):
        build_config({**MINIMAL, "training": {"max_steps": "many"}})
    with pytest.raises(ConfigError, match=r"training.method: 'lorra' is not one of .*did you mean 'lora'"):
        build_config({**MINIMAL, "training": {"method": "lorra"}})
    with pytest.raises(ConfigError, match=r"lora.use_dora: expected true/false"):
        build_config({**MINIMAL, "lora": {"use_dora": "yes"}})
    with pytest.raises(ConfigError, match="bucket_step must be a positive multiple of 16"):
        build_config({"data": {"path": "x", "bucket_step": 24}})
    with pytest.raises(ConfigError, match="data.path is required"):
        build_config({})


def test_overrides_are_yaml_values_on_dotted_paths():
    assert parse_override("optimizer.learning_rate=3e-4") == (["optimizer", "learning_rate"], 3e-4)
    config = build_config(MINIMAL, ["training.max_steps=7", "lora.target_modules=[attn.to_q]", "optimizer.max_grad_norm=null"])
    assert config.training.max_steps == 7
    assert config.lora.target_modules == ["attn.to_q"]
    assert config.optimizer.max_grad_norm is None
    with pytest.raises(ConfigError, match="did you mean 'training.max_steps'"):
        build_config(MINIMAL, ["training.max_step=7"])
    with pytest.raises(ConfigError, match="key=value"):
        parse_override("training.max_steps")


def test_recipes_fill_defaults_and_the_file_wins():
    config = build_config({**MINIMAL, "recipe": "lora-brand", "lora": {"rank": 8}})
    assert config.lora.rank == 8  # the file's value
    assert config.lr_scheduler.name == "wsd" and config.training.max_steps == 2000  # the recipe's
    for name in RECIPES:
        build_config({**MINIMAL, "recipe": name})
    with pytest.raises(ConfigError, match="unknown recipe 'lora-stlye'; did you mean 'lora-style'"):
        build_config({**MINIMAL, "recipe": "lora-stlye"})


@pytest.mark.parametrize("name", ["train_lora_tiny.yaml", "train_brand_lora.yaml"])
def test_examples_parse(name):
    config = load_config(EXAMPLES / name)
    assert config.training.method == "lora"
    assert set(config.export.formats) == {"diffusers", "comfyui", "kohya"}


def test_shuffled_tags_with_vision_token_references_are_refused_by_krea2_train(tmp_path, capsys):
    """Paired samples encode their instruction once with the references as vision tokens: a tag
    shuffle would be silently ignored there, so ``krea2 train`` refuses it, naming the keys."""
    import yaml

    from krea2_diffusers.cli import main

    config = {"model": {"pretrained_model_name_or_path": "tiny-random"},
              "data": {"datasets": [{"path": "pairs-a"}, {"path": "pairs-b", "shuffle_tags": True}], "references": {}}}
    path = tmp_path / "pairs.yaml"
    path.write_text(yaml.safe_dump(config))
    assert main(["train", str(path), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "data.datasets[1].shuffle_tags with data.references.vision_tokens" in err and "datasets[0].shuffle_tags" not in err
    # With the references as latents only the tags go through the plain text cache, shuffled.
    build_config(config, ["data.references.vision_tokens=false"])
