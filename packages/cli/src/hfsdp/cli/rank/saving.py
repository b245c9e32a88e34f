"""When and how the training loop saves: every --save-every steps and at the end, in the loop or in the background.

Synchronous (the default), a save is `save_checkpoint` at the step boundary; training waits for the
whole write. With `--async-save` it is `hfsdp.ckpt.AsyncSaver`: at the step boundary every rank
copies its state to host memory and a background thread writes it while training continues.
Publishing (rank 0 writes the index and moves `latest`) is collective, so the ranks must do it
at the same step boundary: the loop adds this rank's "my file is written" to the all-reduce of
the step's loss (`written`), and after the step every rank sees the same sum and publishes
when all are done (`publish_if`). A second save waits for the first; a stop or the end of the
run waits for the save in flight (`finish`). Retention (--save-keep) runs after each publish,
so the newest published checkpoint is never the one pruned.
"""

from __future__ import annotations

import time
from pathlib import Path

from hfsdp.cli.rank.run_dir import attempt
from hfsdp.cli.settings.train_config import TrainConfig


class Saver:
    """The loop's checkpoints: `due`, `save`, then (async) `publish_if` at later step boundaries and `finish`."""

    def __init__(self, cfg: TrainConfig, model, opt, record: dict, rank: int):
        self.cfg, self.model, self.opt, self.record, self.rank = cfg, model, opt, record, rank
        self.saved: list[Path] = []
        self._async = None
        if cfg.save and cfg.async_save:
            from hfsdp.ckpt import AsyncSaver

            slow = cfg.debug_slow_save if attempt() == 0 else None
            self._async = AsyncSaver(on_written=_stall_at(slow) if slow else None)

    def due(self, step: int) -> bool:
        """Whether the loop saves after step `step` (counted from 1): every --save-every steps, and the last one."""
        cfg = self.cfg
        return bool(cfg.save) and (step == cfg.steps or bool(cfg.save_every and step % cfg.save_every == 0))

    def written(self) -> float:
        """1.0 when this rank has no write in flight (or it finished), else 0.0: a term of the step's all-reduce."""
        return 1.0 if self._async is None or self._async.written() else 0.0

    def before_update(self) -> None:
        if self._async is not None:
            self._async.before_update()

    def save(self, step: int, extra: dict) -> float:
        """Save step `step` (collective); returns the seconds training stood still for it."""
        began = time.perf_counter()
        if self._async is not None:
            self._published(self._async.publish())  # at most one in flight: the previous one first
            self._async.save(self.cfg.save, self.model, self.opt, step=step, extra=extra, model_record=self.record)
        else:
            from hfsdp.ckpt import save_checkpoint

            path = save_checkpoint(
                self.cfg.save, self.model, self.opt, step=step, extra=extra, model_record=self.record
            )
            self._published(path)
        return time.perf_counter() - began

    def publish_if(self, all_written: bool) -> None:
        """Publish the save in flight when every rank's file is written (collective: the same answer on all)."""
        if self._async is not None and self._async.in_flight and all_written:
            self._published(self._async.publish())

    def finish(self) -> None:
        """Wait for the save in flight and publish it (collective; a stop and the end of the run call it)."""
        if self._async is not None:
            self._published(self._async.publish())
            self._async.close()

    @property
    def in_flight(self) -> bool:
        return self._async is not None and self._async.in_flight

    def _published(self, path: Path | None) -> None:
        if path is None:
            return
        self.saved.append(path)
        if self.rank == 0 and self.cfg.save_keep:
            from hfsdp.cli.rank.retention import prune

            prune(self.cfg.save, self.cfg.save_keep)


#: How long --debug-slow-save stalls a background write: until the test that asked for it kills the rank.
STALL_S = 600.0


def _stall_at(step: int):
    """Fault injection (--debug-slow-save): the background write of step `step` stalls after writing its file, as
    on a file system that stopped answering; the test kills a rank meanwhile."""

    def stall(saved: int) -> None:
        if saved == step:
            time.sleep(STALL_S)

    return stall
