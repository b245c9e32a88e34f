"""`--save-keep N`: the newest N checkpoints stay, older ones go, the one `latest` names never does."""

from __future__ import annotations

from pathlib import Path

from hfsdp.cli.rank.retention import checkpoints, prune


def make_root(root: Path, steps: list[int], latest: int, incomplete: tuple[int, ...] = ()) -> Path:
    for step in steps:
        (root / f"step-{step}").mkdir(parents=True)
        if step not in incomplete:
            (root / f"step-{step}" / "index.json").write_text("{}")
    (root / "latest").write_text(f"step-{latest}\n")
    return root


def test_prune_keeps_the_newest(tmp_path):
    """Of steps 5..25 with keep 2, steps 20 and 25 stay; the others are deleted, with nothing hidden left over."""
    root = make_root(tmp_path / "ck", [5, 10, 15, 20, 25], latest=25)
    deleted = prune(root, 2)
    assert sorted(p.name for p in deleted) == ["step-10", "step-15", "step-5"]
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-20", "step-25"]


def test_prune_never_deletes_what_latest_names(tmp_path):
    """Even when `latest` names an older step (a resume saved into a root with newer steps), it survives."""
    root = make_root(tmp_path / "ck", [10, 20, 30], latest=10)
    prune(root, 1)
    assert [p.name for p in checkpoints(root)] == ["step-10", "step-30"]


def test_prune_ignores_what_is_not_a_checkpoint(tmp_path):
    """Directories without an index (another tool's, or a save's leftovers) are not counted nor deleted."""
    root = make_root(tmp_path / "ck", [1, 2, 3], latest=3, incomplete=(1,))
    (root / "notes").mkdir()
    prune(root, 1)
    assert sorted(p.name for p in root.iterdir()) == ["latest", "notes", "step-1", "step-3"]
