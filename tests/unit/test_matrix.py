"""The supported-configurations matrix on the docs page is the one tests/matrix.py
generates from the tests' `supports` markers, and every cell it promises has a test or a reason."""

from __future__ import annotations

import pytest

from tests import matrix


class TestMatrix:
    @pytest.mark.parametrize("page", matrix.PAGES, ids=lambda p: p.name)
    def test_every_required_cell_has_a_row(self, page):
        """Every REQUIRED cell has a row on each page; one with no test says so (**no test**)."""
        table = matrix.page_table(page.read_text())
        for name in matrix.missing(matrix.collect()):
            framework, setting, value = (part.strip() for part in name.replace(" = ", " / ").split(" / "))
            assert f"| {framework} | {setting} | {value} | **no test** | |" in table

    @pytest.mark.parametrize("page", matrix.PAGES, ids=lambda p: p.name)
    def test_page_table_is_the_generated_one(self, page):
        """Each page of PAGES (the docs page) holds exactly the table `make matrix` writes (rerun
        it after changing a marker)."""
        assert matrix.page_table(page.read_text()) == matrix.render(matrix.collect())

    def test_write_rewrites_only_the_table(self, tmp_path):
        """`write_table` replaces what lies between the markers and leaves the rest of the page alone."""
        page = tmp_path / "page.md"
        page.write_text(f"# Title\n\nbefore\n{matrix.BEGIN}\n| old |\n{matrix.END}\nafter\n")
        matrix.write_table(page, "| new |")
        assert page.read_text() == f"# Title\n\nbefore\n{matrix.BEGIN}\n| new |\n{matrix.END}\nafter\n"

    def test_a_tested_cell_names_its_tests(self):
        """Each tested cell lists the node ids of the tests that prove it; refused ones say the error."""
        cells = matrix.collect()
        assert all(c.proofs for c in cells.values() if c.status == matrix.TESTED)
        assert all(c.status.startswith(("tested here", "refused: ", "not runnable here: ")) for c in cells.values())

    def test_markers_take_literals(self, tmp_path, monkeypatch):
        """A marker whose arguments are not string literals is an error, not a silently missing cell."""
        (tmp_path / "test_x.py").write_text(
            "import pytest\nV = 'a'\n@pytest.mark.supports('TRL', 'x', V)\ndef test_x():\n    pass\n")
        monkeypatch.setattr(matrix, "ROOT", tmp_path)
        with pytest.raises(ValueError, match="string literals"):
            matrix.collect(tmp_path)
