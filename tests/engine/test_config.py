"""Config loading: TOML + dotted overrides, validation errors that name the field, every setting documented
(docs/configuration.md itself: tests/tools/test_config_reference.py)."""

import tomllib

import pytest

from tailrace.engine.config import RunConfig, from_dict, load_config, reference_markdown, to_toml


def test_defaults_and_overrides(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('[train]\nlr = 1e-3\nsteps = 7\n[sampling]\ngroup_size = 4\n')
    cfg = load_config(path, ["--train.lr", "2e-4", "--generator.in_flight_update=false",
                             "--train.betas", "0.8,0.9"])
    assert cfg.train.lr == 2e-4 and cfg.train.steps == 7 and cfg.sampling.group_size == 4
    assert cfg.generator.in_flight_update is False and cfg.train.betas == (0.8, 0.9)


@pytest.mark.parametrize("overrides, match", [
    (["--train.lr", "-1"], "train.lr"),
    (["--train.nope", "1"], "train.nope: unknown setting"),
    (["--sampling.group_size", "many"], "sampling.group_size"),
    (["--reward.mode", "magic"], "reward.mode"),
    (["--train.steps"], "missing value"),
    (["train.steps", "3"], "expected --section.name"),
    (["--env.max_turns", "3", "--generator.backend", "vllm"], "env.max_turns: 3 turns: .* \"torch\" only"),
    (["--env.max_turns", "2", "--generator.tree_fork_depths", "4"], "env.max_turns: .*tree_fork_depths"),
    (["--env.stop_strings", "ab"], "env.stop_strings: .*multi-turn"),
    (["--env.max_turns", "2", "--env.stop_strings", "a,,b"], "env.stop_strings: '': .*non-empty"),
    (["--env.max_turns", "2", "--env.stop_strings", "x" * 65], "env.stop_strings: .*at most 64"),
])
def test_bad_settings_name_the_field(overrides, match):
    with pytest.raises(ValueError, match=match):
        load_config(None, overrides)


def test_resolved_config_round_trips(tmp_path):
    cfg = load_config(None, ["--train.steps", "3", "--data.task", "copy"])
    path = tmp_path / "resolved.toml"
    path.write_text(to_toml(cfg))
    assert load_config(path) == cfg


def test_resolved_config_round_trips_strings_toml_must_escape(tmp_path):
    cfg = load_config(None, ["--data.prompt_field", 'q"uote\\back\tslash\nnew line', "--model.path", "C:\\m\u00e9"])
    cfg.data.prompt_field = 'q"uote\\ tab\t newline\n bell\x07'
    path = tmp_path / "resolved.toml"
    path.write_text(to_toml(cfg))
    assert load_config(path) == cfg


def test_every_setting_is_documented():
    for line in reference_markdown().splitlines()[2:]:
        assert not line.endswith("|  |"), f"undocumented setting: {line}"


def test_speculation_values_old_and_new():
    # The setting was a boolean: true / false (TOML or command line) keep working, as on / off.
    assert load_config().generator.speculation == "auto"
    assert load_config().generator.spec_drafters == ("eagle", "suffix")
    for given, resolved, drafters in (("true", "on", ("eagle", "suffix")), ("false", "off", ()),
                                      ("suffix", "suffix", ("suffix",)), ("EAGLE", "eagle", ("eagle",))):
        gen = load_config(None, ["--generator.speculation", given]).generator
        assert (gen.speculation, gen.spec_drafters) == (resolved, drafters)
    assert from_dict(RunConfig, {"generator": {"speculation": True}}).generator.speculation == "on"
    assert from_dict(RunConfig, {"generator": {"speculation": False}}).generator.spec_drafters == ()
    vllm = load_config(None, ["--generator.backend", "vllm"]).generator
    assert vllm.speculation == "auto" and vllm.spec_drafters == ()  # auto: off where there is none
    with pytest.raises(ValueError, match="generator.speculation"):
        load_config(None, ["--generator.backend", "vllm", "--generator.speculation", "eagle"])
    with pytest.raises(ValueError, match="generator.speculation"):
        load_config(None, ["--generator.speculation", "medusa"])
    resolved = load_config(None, ["--generator.speculation", "true"])
    assert from_dict(RunConfig, tomllib.loads(to_toml(resolved))).generator.speculation == "on"


def test_stop_strings_from_toml_keep_whitespace(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('[env]\nmax_turns = 2\nstop_strings = ["\\n\\n", " </answer>"]\n')
    cfg = load_config(path)
    assert cfg.env.stop_strings == ("\n\n", " </answer>")
    path.write_text(to_toml(cfg))
    assert load_config(path) == cfg
