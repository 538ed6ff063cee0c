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
    start = readme.index("| config | what |")
    table = readme[start:readme.index("\n\n", start)]  # the table's rows, up to the blank line after it
    for config in sorted((ROOT / "configs").glob("*.yaml")):
        assert f"`configs/{config.name}`" in table, config.name


def test_the_readme_is_a_newcomers_page_whose_docs_links_resolve():
    """At most 300 lines (issue #43); the reference lives in docs/, and every page it names exists."""
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 300
    linked = set(re.findall(r"\]\((docs/[^)#]+)", readme))
    named = set(re.findall(r"\bdocs/[A-Za-z_]+\.md\b", readme))
    assert {"docs/LAYOUTS.md", "docs/DATA.md", "docs/FAULTS.md", "docs/CHECKPOINTS.md", "docs/CLUSTERS.md",
            "docs/BENCHMARKS.md"} <= linked
    for page in sorted(linked | named):
        assert (ROOT / page).is_file(), page
