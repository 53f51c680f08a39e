"""What a verified weight sync costs (``RLConfig.verify_sync``): per engine, the seconds of one
weight sync (the trainer's export into the engine, in process) against the seconds of
verifying it by fingerprint (``SupportsWeightFingerprints``: hash both sides) and by the
probe (16 greedy tokens and the trainer's log-probs of them), interleaved, in the same run.

    .venv/bin/python benchmarks/verify_sync.py [--engines torch,hf] [--width 512] [--layers 4]
    .venv-vllm/bin/python benchmarks/verify_sync.py --engines vllm     # vLLM's CPU build

``torch``: the reference engines; ``hf``: a random Qwen2 of the given shape (HF engines);
``vllm``: the same Qwen2 served by an in-process vLLM (``VLLMEngine``, the worker extension's
load; vLLM on CPU packs its linear weights, so only the probe applies) with the HF trainer.
A table, then the last stdout line as JSON with every measurement and the load average.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))


class _NoFingerprints:
    """The engine seen without ``weight_fingerprints``: forces the probe."""

    def __init__(self, engine: Any) -> None:
        self._engine = engine

    def __getattr__(self, name: str) -> Any:
        if name == "weight_fingerprints":
            raise AttributeError(name)
        return getattr(self._engine, name)


async def _sync(engine: Any, trainer: Any, version: int) -> float:
    from asyncflow_core.sync.transports import InProcessWeightSync

    t0 = time.perf_counter()
    sync = InProcessWeightSync([engine])
    await sync.init()
    await sync.start()
    async for bucket in trainer.export_weights(1 << 30):
        await sync.update(bucket)
    await sync.finish(version)
    return time.perf_counter() - t0


async def _pair(kind: str, args: argparse.Namespace, tmp: Path) -> tuple[Any, Any, int]:
    if kind == "torch":
        from asyncflow_reference.engines import TorchInferenceEngine, TorchTrainEngine
        from asyncflow_reference.model import ModelConfig

        config = ModelConfig(
            vocab_size=512, d_model=args.width, n_layers=args.layers,
            n_heads=max(1, args.width // 64), max_seq_len=256,
        )  # fmt: skip
        engine = TorchInferenceEngine(config, max_batch=4, seed=0, threads=1)
        trainer = TorchTrainEngine(config, seed=1, threads=1)
        return engine, trainer, 0
    from vllm_weight_load import make_model

    folder = tmp / "model"
    if not folder.exists():
        make_model(folder, args.width, args.layers)
    from asyncflow_hf import HFTrainEngine

    trainer = HFTrainEngine(str(folder), threads=1, seed=1)
    if kind == "hf":
        from asyncflow_hf import HFInferenceEngine

        return HFInferenceEngine(str(folder), max_batch=4, threads=1), trainer, 0
    from asyncflow_vllm import VLLMEngine

    engine = await VLLMEngine.create(str(folder), dtype="float32", enforce_eager=True)
    return engine, trainer, engine.weight_version


async def main_async(args: argparse.Namespace) -> None:
    from asyncflow_core.sync.verify import SupportsWeightFingerprints, verify_engine

    rows: list[dict[str, Any]] = []
    kinds = [k.strip() for k in args.engines.split(",") if k.strip()]
    with tempfile.TemporaryDirectory() as tmp:
        for kind in kinds:
            engine, trainer, version = await _pair(kind, args, Path(tmp))
            try:
                nbytes = 0
                async for bucket in trainer.export_weights(1 << 30):
                    nbytes += bucket.nbytes
                has_prints = isinstance(engine, SupportsWeightFingerprints)
                print(f"{kind}: {nbytes / 1e6:.1f} MB of weights; fingerprints: {has_prints}; "
                      f"load average {os.getloadavg()[0]:.2f}", flush=True)  # fmt: skip
                for round_ in range(args.rounds):
                    version += 1
                    trainer_version = trainer.weight_version
                    sync_s = await _sync(engine, trainer, trainer_version)
                    row: dict[str, Any] = {"engine": kind, "round": round_, "mb": nbytes / 1e6,
                                           "sync_s": sync_s}  # fmt: skip
                    checks = [("probe", _NoFingerprints(engine))]
                    if has_prints:
                        checks.insert(0 if round_ % 2 else 1, ("fingerprint", engine))
                    for label, target in checks:  # interleaved: the order alternates
                        t0 = time.perf_counter()
                        report = await verify_engine(
                            target, trainer, trainer_version, who=kind, kind="auto"
                        )
                        row[f"{label}_s"] = time.perf_counter() - t0
                        assert report.kind == label, report
                    row["load"] = os.getloadavg()[0]
                    rows.append(row)
                    print(json.dumps({k: round(v, 4) if isinstance(v, float) else v
                                      for k, v in row.items()}), flush=True)  # fmt: skip
            finally:
                await engine.close()
                await trainer.close()
    print(f"\n{'engine':<7} {'MB':>7} {'sync s':>8} {'fingerprint s':>13} {'x sync':>6} "
          f"{'probe s':>8} {'x sync':>6}")  # fmt: skip
    medians = []
    for kind in kinds:
        mine = [r for r in rows if r["engine"] == kind]
        med = {k: statistics.median(r[k] for r in mine) for k in mine[0] if k.endswith("_s")}
        fp = med.get("fingerprint_s")
        medians.append({"engine": kind, "mb": mine[0]["mb"], **med})
        fp_text = (
            f"{fp:>13.4f} {fp / med['sync_s']:>6.2f}" if fp is not None else f"{'-':>13} {'-':>6}"
        )
        print(f"{kind:<7} {mine[0]['mb']:>7.1f} {med['sync_s']:>8.4f} {fp_text} "
              f"{med['probe_s']:>8.4f} {med['probe_s'] / med['sync_s']:>6.2f}")  # fmt: skip
    print(json.dumps({"width": args.width, "layers": args.layers, "rounds": args.rounds,
                      "medians": medians, "runs": rows}))  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engines", default="torch,hf")
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    asyncio.run(main_async(args))


if __name__ == "__main__":
    main()
