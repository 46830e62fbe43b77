"""The supported-configurations matrix, generated from the tests that prove each cell.

A test proves a cell with a marker whose arguments are string literals:

    @pytest.mark.supports("TRL", "loss_type", "grpo", "dapo")            # tested here
    @pytest.mark.supports("TRL", "gradient accumulation", "GA > spg x iterations",
                          status="refused: ConfigError naming gradient_accumulation_steps")

A tested cell's test runs the configuration for real (healthy: no alarm; a fault: caught); a refused
cell's test asserts the refusal (before the engine starts). Cells no test here can run are listed in
NOT_RUNNABLE with the reason. REQUIRED is every cell the docs answer for: a cell with neither a test
nor a reason reads **no test** there; the unit test (tests/unit/test_matrix.py) fails when a page's
table (PAGES: the docs' Supported configurations page) is not the one
`render` makes from the tests (`make matrix` rewrites them).

    python -m tests.matrix            # print the table
    python -m tests.matrix --write    # rewrite it in every page of PAGES
"""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS_PAGE = ROOT / "docs" / "integrations" / "supported.md"
PAGES = (DOCS_PAGE,)
"""The pages that hold the table between BEGIN and END."""
BEGIN, END = "<!-- matrix:begin (make matrix writes this table from the tests) -->", "<!-- matrix:end -->"
TESTED = "tested here"

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo")
REQUIRED: dict[tuple[str, str], tuple[str, ...]] = {
    ("TRL", "loss_type"): LOSS_TYPES,
    ("TRL", "model"): ("plain", "LoRA (peft)"),
    ("TRL", "vllm_mode"): ("colocate", "server"),
    ("TRL", "num_iterations"): ("1", "2"),
    ("TRL", "steps_per_generation x num_iterations vs gradient_accumulation_steps"): (
        "spg x iterations >= GA", "spg x iterations < GA"),
    ("TRL", "processes"): ("1", "2"),
    ("TRL", "precision"): ("fp32", "bf16"),
    ("TRL", "vLLM"): ("0.31", "0.32"),
    ("verl", "trainer"): ("legacy RayPPOTrainer", "v1", "fully async, partial rollouts", "bypass mode"),
    ("own loop", "trainer"): ("FSDP2", "ZeRO-3", "hf"),
    ("own loop", "tensor_parallel_size"): ("1", "2"),
}
"""Every (framework, setting) the matrix answers for, with its values."""

NOT_RUNNABLE: dict[tuple[str, str, str], str] = {}
"""(framework, setting, value) -> why no test here can run it (a stand-in test may still cover rlcheck's side)."""


@dataclass
class Cell:
    framework: str
    setting: str
    value: str
    status: str = TESTED
    proofs: list[str] = field(default_factory=list)


def _literal(node: ast.AST) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def _marks(node: ast.AST):
    """The `pytest.mark.supports(...)` calls decorating `node`."""
    for dec in getattr(node, "decorator_list", []):
        if (isinstance(dec, ast.Call) and isinstance(dec.func, ast.Attribute) and dec.func.attr == "supports"):
            yield dec


def _proofs(path: Path):
    """(node id, framework, setting, value, status) for every supports marker in one test file."""
    rel = path.relative_to(ROOT).as_posix()

    def walk(body, prefix):
        for node in body:
            if isinstance(node, ast.ClassDef | ast.FunctionDef):
                node_id = f"{prefix}::{node.name}"
                for call in _marks(node):
                    args = [_literal(a) for a in call.args]
                    if len(args) < 3 or None in args:
                        raise ValueError(f"{node_id}: supports() takes string literals: framework, setting, value...")
                    status = next((_literal(k.value) for k in call.keywords if k.arg == "status"), TESTED)
                    for value in args[2:]:
                        yield node_id, args[0], args[1], value, status
                if isinstance(node, ast.ClassDef):
                    yield from walk(node.body, node_id)

    yield from walk(ast.parse(path.read_text()).body, rel)


def collect(root: Path = ROOT / "tests") -> dict[tuple[str, str, str], Cell]:
    """Every cell some test proves (or NOT_RUNNABLE explains), keyed by (framework, setting, value)."""
    cells: dict[tuple[str, str, str], Cell] = {}
    for path in sorted(root.rglob("test_*.py")):
        for node_id, framework, setting, value, status in _proofs(path):
            cell = cells.setdefault((framework, setting, value), Cell(framework, setting, value, status))
            if cell.status != status:
                raise ValueError(f"{node_id}: {framework}/{setting}={value} is '{status}' here, '{cell.status}' elsewhere")
            cell.proofs.append(node_id)
    for key, reason in NOT_RUNNABLE.items():
        cells.setdefault(key, Cell(*key, status=f"not runnable here: {reason}"))
    return cells


def missing(cells: dict[tuple[str, str, str], Cell]) -> list[str]:
    """REQUIRED cells with neither a test nor a reason."""
    return [f"{fw} / {setting} = {value}" for (fw, setting), values in REQUIRED.items()
            for value in values if (fw, setting, value) not in cells]


def render(cells: dict[tuple[str, str, str], Cell]) -> str:
    """The table: REQUIRED's cells first, in its order, then any other proved cell."""
    order = [(fw, s, v) for (fw, s), values in REQUIRED.items() for v in values]
    order += sorted(k for k in cells if k not in order)
    rows = ["| framework | setting | value | status | proved by |", "|---|---|---|---|---|"]
    for key in order:
        cell = cells.get(key)
        if cell is None:
            rows.append(f"| {key[0]} | {key[1]} | {key[2]} | **no test** | |")
            continue
        proofs = "<br>".join(f"`{p.removeprefix('tests/')}`" for p in cell.proofs)
        rows.append(f"| {cell.framework} | {cell.setting} | {cell.value} | {cell.status} | {proofs} |")
    return "\n".join(rows)


def page_table(text: str) -> str:
    """The table between a page's matrix markers."""
    start, stop = text.index(BEGIN) + len(BEGIN), text.index(END)
    return text[start:stop].strip("\n")


def write_table(page: Path, table: str) -> None:
    """Replace the table between `page`'s matrix markers."""
    text = page.read_text()
    start, stop = text.index(BEGIN) + len(BEGIN), text.index(END)
    page.write_text(text[:start] + "\n" + table + "\n" + text[stop:])


def main(argv: list[str]) -> int:
    table = render(collect())
    if "--write" not in argv:
        print(table)
        return 0
    for page in PAGES:
        write_table(page, table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
