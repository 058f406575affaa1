"""docs/configuration.md's settings table is the one the config models generate, and every setting
has a description."""

from pathlib import Path

from serving.config import DeploymentConfig
from serving.config_doc import replaced, settings

DOC = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"


def test_the_docs_settings_table_is_the_generated_one():
    text = DOC.read_text()
    assert replaced(text) == text, "regenerate it: python -m serving.config_doc --write docs/configuration.md"


def test_every_setting_says_what_it_sets():
    assert [path for path, _, description in settings(DeploymentConfig()) if not description] == []
