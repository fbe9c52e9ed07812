"""A small training job for the kill-and-resume test (run as a script).

``resume_job.py DIR STEPS [--kill-after K] [--resume] [--delta-remote]``: trains a model with
dropout on a shuffled ResumableSampler, with numpy and Python randomness in
each step and a step-decay scheduler, checkpointing every 3 steps with a
Checkpointer (the RunState in each checkpoint). ``--kill-after K`` makes the
process SIGKILL itself once step K is done (after its checkpoints so far are
durable); ``--resume`` continues from the newest checkpoint. Each step's loss
is appended to ``DIR/losses.txt`` (``step hex``); the final model and
optimizer state go to ``DIR/final.pt``. ``--delta-remote`` adds a remote
tier storing deltas (``Delta(keyframe_every=2)``) and, with ``--resume``,
deletes the local tier first, so that the resume decodes the remote copy.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
from pathlib import Path

import numpy as np
import torch

import tierstore


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("dir")
    ap.add_argument("steps", type=int)
    ap.add_argument("--kill-after", type=int, default=None)
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--delta-remote", action="store_true")
    args = ap.parse_args()
    d = Path(args.dir)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    np.random.seed(0)
    random.seed(0)

    g = torch.Generator().manual_seed(123)
    data = torch.utils.data.TensorDataset(torch.randn(40, 10, generator=g), torch.randn(40, 1, generator=g))
    sampler = tierstore.ResumableSampler(len(data), shuffle=True, seed=7)
    # The loader's own generator: a new iterator (as after a resume) then draws nothing from torch's global RNG.
    loader = torch.utils.data.DataLoader(data, batch_size=6, sampler=sampler, generator=torch.Generator())
    model = torch.nn.Sequential(torch.nn.Linear(10, 32), torch.nn.Dropout(0.3), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.5)
    noise = np.random.default_rng(5)
    run = tierstore.RunState(sampler=sampler, scheduler=sched, noise=noise)
    tiers: list[tierstore.HostTier | tierstore.DiskTier] = [tierstore.HostTier(), tierstore.DiskTier(".", keep_last=2)]
    if args.delta_remote:
        tiers.append(tierstore.RemoteTier(str(d / "remote"), codec=tierstore.Delta(keyframe_every=2)))
        if args.resume:
            import shutil

            for p in (d / "ckpt").glob("step-*"):
                shutil.rmtree(p)  # the local tier is lost: the remote deltas are all there is
    ckpt = tierstore.Checkpointer(d / "ckpt", tiers=tiers)
    ckpt.attach(opt)  # the next optimizer step waits until the checkpoint's tensors are captured

    step = 1
    if args.resume:
        state = ckpt.load_latest()
        assert state is not None, "no checkpoint to resume from"
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optim"])
        run.load_state_dict(state["run"])
        step = state["step"] + 1
    losses = open(d / "losses.txt", "a")  # noqa: SIM115 (appended step by step, kept across the kill)
    while step <= args.steps:
        for x, y in loader:
            jitter = float(np.random.randn()) * 0.01 + random.random() * 0.01 + float(noise.normal()) * 0.01
            loss = (model(x + jitter) - y).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            sched.step()
            losses.write(f"{step} {loss.item().hex()}\n")
            losses.flush()
            if step % 3 == 0:
                ckpt.save(step, {"model": model.state_dict(), "optim": opt.state_dict(), "run": run.state_dict(),
                                 "step": step})  # fmt: skip
            if args.kill_after is not None and step == args.kill_after:
                ckpt.wait()
                os.kill(os.getpid(), signal.SIGKILL)
            step += 1
            if step > args.steps:
                break
    ckpt.wait()
    ckpt.close()
    tierstore.save({"model": model.state_dict(), "optim": opt.state_dict()}, d / "final.pt")


if __name__ == "__main__":
    main()
