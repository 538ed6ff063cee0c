"""Scripts and docs that keep up with the repository (static checks, no processes)."""
import re

from conftest import ROOT


def test_every_bench_script_makes_its_venv_as_train_and_test_do():
    for script in sorted((ROOT / "scripts").glob("bench_*.sh")):
        text = script.read_text()
        assert re.search(r'^source "\$\(dirname "\$\{BASH_SOURCE\[0\]\}"\)/_env\.sh"$', text, re.M), script.name
        assert re.search(r"^install_project ", text, re.M), script.name


def test_the_readme_config_table_lists_every_config():
    readme = (ROOT / "README.md").read_text()
    table = readme[readme.index("| config | what |"):readme.index("### MoE vs dense")]
    for config in sorted((ROOT / "configs").glob("*.yaml")):
        assert f"`configs/{config.name}`" in table, config.name
