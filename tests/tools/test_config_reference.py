"""docs/configuration.md is what tools/config_reference.py writes from the config dataclasses today, and it
names every setting with its default. Run: pytest tests/tools/test_config_reference.py
"""

from tailrace.engine.config import RunConfig, _inline, setting_names
from tools import config_reference


def test_configuration_page_is_current():
    assert config_reference.PAGE.read_text(encoding="utf-8") == config_reference.render(), (
        "docs/configuration.md is stale: run python tools/config_reference.py")
    assert config_reference.main(["--check"]) == 0


def test_every_setting_has_a_row_with_its_default_under_its_section():
    page = config_reference.render()
    sections = page.split("\n## [")[1:]
    rows = {}
    for section in sections:
        name = section.partition("]")[0]
        for line in section.splitlines():
            if line.startswith("| `"):
                setting, default = line.split("`")[1], line.split("`")[3]
                assert setting.rpartition(".")[0] == name, f"{setting} listed under [{name}]"
                rows[setting] = default
    assert set(rows) == setting_names()
    defaults = RunConfig()
    for setting, default in rows.items():
        value = defaults
        for part in setting.split("."):
            value = getattr(value, part)
        assert default == _inline(value), setting


def test_a_stale_page_is_reported(tmp_path, monkeypatch, capsys):
    stale = tmp_path / "configuration.md"
    stale.write_text(config_reference.render().replace("AdamW learning rate", "the learning rate"))
    monkeypatch.setattr(config_reference, "PAGE", stale)
    monkeypatch.setattr(config_reference, "REPO_ROOT", tmp_path)
    assert config_reference.main(["--check"]) == 1
    assert "stale" in capsys.readouterr().err
    assert config_reference.main([]) == 0 and config_reference.main(["--check"]) == 0
