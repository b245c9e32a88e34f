"""`hfsdp plan --plot FILE.png`: predicted step time against per-rank memory, one point per layout, the limit drawn.

matplotlib is imported here only (the `plot` extra of hfsdp-cli); `plan` refuses --plot before
any work when it is missing.
"""

from __future__ import annotations

from hfsdp.planning.candidates import Evaluated

GIB = 2**30


def plot(path: str, inputs, rows: list[Evaluated], best: Evaluated | None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 6), dpi=110)
    for fits, color, label in ((True, "tab:blue", "fits"), (False, "tab:red", "does not fit")):
        chosen = [r for r in rows if r.fits == fits]
        if chosen:
            ax.scatter(
                [r.memory.total / GIB for r in chosen], [r.time.step_s for r in chosen], c=color, s=18, label=label
            )
    for r in rows:
        if r.standard or r is best:
            ax.annotate(
                r.name, (r.memory.total / GIB, r.time.step_s), fontsize=7, xytext=(3, 3), textcoords="offset points"
            )
    if best is not None:
        ax.scatter([best.memory.total / GIB], [best.time.step_s], marker="*", s=160, c="gold", edgecolors="k", zorder=3,
                   label=f"recommended: {best.name}")  # fmt: skip
    ax.axvline(inputs.cluster.gpu_memory_gib, color="k", linestyle="--", linewidth=1, label="GPU memory")
    ax.set_xlabel("predicted peak memory per rank (GiB)")
    ax.set_ylabel("predicted step time (s)")
    ax.set_title(
        f"{inputs.shape.describe()}\non {inputs.cluster.nodes} x {inputs.cluster.gpus_per_node} GPUs", fontsize=9
    )
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
