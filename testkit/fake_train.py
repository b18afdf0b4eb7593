"""A tiny stand-in for `python -m dflash train`: prints step lines, writes metrics.jsonl to
$DFLASH_RUN_DIR, then ends the way the test asks. stdlib only (it runs inside the fake container).

    fake_train.py [--steps N] [--interval S] [--lines N] [--cr] [--binary]
                  [--until FILE] [--then exit:N|die:N|oom|oom-old|exception|value-error|nccl-timeout|cuda-ecc|cuda-launch|diverged|kill|forever]
                  [--checkpoint FILE [--every K]] [--control FILE] [--ignore-signals] [--gpus BUS,BUS...]

--until FILE keeps stepping until FILE exists (the test decides when the run ends).
--checkpoint FILE resumes from the step counter in FILE and saves it there (write, then rename)
every K steps, as the training core does with `resume = "auto"`.
--control FILE is read before each step: `once:KIND[@N]` (the file is taken, so a restarted run does
not repeat it) or `always:KIND[@N]` (every run does it), KIND as for --then (`forever` is a hang
without output; `spike` prints the trainer's loss-spike warning and goes on), @N: after N steps of this run.
The control file's next lines are printed as they are just before the fault (what a program prints: a
data sample, a warning it recovered from); KIND `say` prints them and goes on. `value-error[:TEXT]`
raises ValueError, `die:N` exits N without a word.
--ignore-signals ignores SIGINT and SIGTERM (a process only SIGKILL ends).
--gpus BUS,...: the PCI bus ids of its drafter GPUs; with $DFLASH_EXCLUDED_GPUS set it says its layout line
and, when every one is excluded, dflash train's no-device line (exit 1), as dflash.train.devices does.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time

CHECKPOINT: tuple[str | None, int] = (None, 5)  # --checkpoint and --every: the diverged line names it


def log(text: str) -> None:
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--interval", type=float, default=0.05)
    p.add_argument("--lines", type=int, default=0, help="print `line 1..N` first")
    p.add_argument("--cr", action="store_true", help="print a \\r progress row")
    p.add_argument("--binary", action="store_true", help="print bytes that are not UTF-8")
    p.add_argument("--until", default=None)
    p.add_argument("--then", default="exit:0")
    p.add_argument("--checkpoint", default=None)
    p.add_argument("--every", type=int, default=5)
    p.add_argument("--control", default=None)
    p.add_argument("--ignore-signals", action="store_true")
    p.add_argument("--gpus", default="")
    a = p.parse_args()
    if a.ignore_signals:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)

    global CHECKPOINT
    CHECKPOINT = (a.checkpoint, a.every)
    run_dir = os.environ.get("DFLASH_RUN_DIR", ".")
    for i in range(1, a.lines + 1):
        log(f"line {i}")
    if a.cr:
        sys.stdout.write("loading 10%\rloading 50%\rloading 100%\n")
        sys.stdout.flush()
    if a.binary:
        sys.stdout.buffer.write(b"bad bytes \xff\xfe here\n")
        sys.stdout.flush()
    if not devices(a.gpus):
        return 1
    step = resume(a.checkpoint)
    if step:
        log(f"resumed from checkpoint at step {step}")
        # the training core's own line (dflash/train.py, the log format of dflash/__main__.py): history reads it
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S")
        log(f"{stamp} INFO dflash.train: resuming from {a.checkpoint} at step {step} (run fake-{os.getpid()})")
    done_here = 0
    while step < a.steps or (a.until and not os.path.exists(a.until)):
        fault, said = control(a.control, done_here)
        for line in said:
            log(line)
        if (
            fault == "spike"
        ):  # dflash train's warning (dflash.train.divergence.Spike.line, the log format): the run goes on
            stamp = time.strftime("%Y-%m-%dT%H:%M:%S")
            log(
                f"{stamp} WARNING dflash.metrics: loss spike at step {step}: loss 9.500 above 3 x the running "
                "median 2.000 for 20 steps"
            )
            with open(os.path.join(run_dir, "metrics.jsonl"), "a") as f:  # and its record (Spike.record)
                spike = {"event": "loss-spike", "step": step, "loss": 9.5, "median": 2.0, "factor": 3.0, "steps": 20}
                f.write(json.dumps(spike) + "\n")
        elif fault and fault != "say":
            return end(fault, step)
        step += 1
        done_here += 1
        loss = round(3.0 / step, 4)
        log(f"step {step} | loss {loss} | acc 0.5 | tau_tf 2.0 | 12.5 Ktok/s | queue 3/8 | drafters 1/1")
        with open(os.path.join(run_dir, "metrics.jsonl"), "a") as f:
            f.write(
                json.dumps(
                    {
                        "step": step,
                        "loss": loss,
                        "ktok_s": 12.5,
                        "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                    }
                )
                + "\n"
            )
        if a.checkpoint and step % a.every == 0:
            save(a.checkpoint, step)
        time.sleep(a.interval)
    return end(a.then, step)


def _bus(text: str) -> str:
    """``0000:3b:00.0`` and ``3b:00`` -> ``3b:00`` (bus:device)."""
    return ":".join(text.lower().split(".")[0].split(":")[-2:])


def devices(gpus: str) -> bool:
    """dflash train's start with $DFLASH_EXCLUDED_GPUS: its layout line, or its no-device line (False)."""
    excluded = os.environ.get("DFLASH_EXCLUDED_GPUS")
    if not excluded:
        return True
    mine = [x for x in gpus.split(",") if x]
    gone = {_bus(x) for x in excluded.split(",") if x}
    kept = [x for x in mine if _bus(x) not in gone]
    if mine and not kept:
        sys.stderr.write(
            f"dflash: DFLASH_EXCLUDED_GPUS={excluded} leaves no drafter device of {len(mine)} drafters {mine} "
            "(excluded: all); the run cannot start\n"
        )
        sys.stderr.flush()
        return False
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S")
    log(
        f"{stamp} INFO dflash.train: devices: DFLASH_EXCLUDED_GPUS={excluded}: {len(mine)} drafters -> {len(kept)} drafters"
    )
    return True


def resume(path: str | None) -> int:
    try:
        with open(path or "") as f:
            return int(json.load(f)["step"])
    except (OSError, ValueError, KeyError):
        return 0


def save(path: str, step: int) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump({"step": step}, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def control(path: str | None, done_here: int) -> tuple[str | None, list[str]]:
    """The fault the control file asks for now, if any (a `once:` file is taken when it fires), and the
    lines to print before it."""
    try:
        with open(path or "") as f:
            first, *said = f.read().strip("\n").split("\n")
    except OSError:
        return None, []
    mode, _, rest = first.strip().partition(":")
    kind, _, after = rest.partition("@")
    if done_here < int(after or 0):
        return None, []
    if mode == "once":
        try:
            os.unlink(path)  # type: ignore[arg-type]
        except FileNotFoundError:
            return None, []  # taken by another run
    return kind, said


def end(how: str, step: int) -> int:
    kind, _, arg = how.partition(":")
    if kind == "exit":
        log(f"done after {step} steps")
        return int(arg or 0)
    if kind == "oom":
        log("Traceback (most recent call last):")
        log('  File "/root/dflash/dflash/train.py", line 88, in step')
        log("    loss.backward()")
        log(
            "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 5 has a total capacity "
            "of 79.25 GiB of which 1.06 GiB is free. Of the allocated memory 74.1 GiB is allocated by PyTorch."
        )
        return 1
    if kind == "oom-old":
        log("Traceback (most recent call last):")
        log('  File "train.py", line 10, in <module>')
        log(
            "RuntimeError: CUDA out of memory. Tried to allocate 20.00 MiB (GPU 3; 7.79 GiB total capacity; "
            "6.50 GiB already allocated; 3.44 MiB free; 6.60 GiB reserved in total by PyTorch)"
        )
        return 1
    if kind == "exception":
        raise KeyError(arg or "missing_key")
    if kind == "value-error":
        raise ValueError(arg or "bad row in shard 3")
    if kind == "die":
        return int(arg or 1)
    if kind in ("cuda-ecc", "cuda-launch"):
        # torch's words when the GPU failed under it (the Xid is in the kernel log, not here)
        what = "uncorrectable ECC error encountered" if kind == "cuda-ecc" else "unspecified launch failure"
        log("Traceback (most recent call last):")
        log('  File "/root/dflash/dflash/train.py", line 88, in step')
        log("    loss.backward()")
        log(f"RuntimeError: CUDA error: {what}")
        log(
            "CUDA kernel errors might be asynchronously reported at some other API call, so the stacktrace below might be incorrect."
        )
        log("For debugging consider passing CUDA_LAUNCH_BLOCKING=1")
        log("Compile with `TORCH_USE_CUDA_DSA` to enable device-side assertions.")
        return 1
    if kind == "diverged":  # dflash train's one line for a non-finite update (dflash.train.divergence.Diverged), exit 3
        path, every = CHECKPOINT
        saved = step - step % every if path else 0
        last = f"{path} (step {saved})" if path and saved else "none"
        sys.stderr.write(f"dflash: diverged at step {step + 1}: loss not finite; last finite checkpoint: {last}\n")
        sys.stderr.flush()
        return 3
    if kind == "nccl-timeout":
        log(
            "[Rank 3] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=42, OpType=ALLREDUCE, "
            "NumelIn=1, NumelOut=1, Timeout(ms)=600000) ran for 600081 milliseconds before timing out."
        )
        os.kill(os.getpid(), signal.SIGABRT)
    if kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if kind == "forever":
        while True:
            time.sleep(1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
