"""Compose a streaming pipeline in Python over the DataStore: a feeder writes prompts in GRPO
groups, a "rollout" task answers whole groups, a "reward" task scores each answer, and a
"trainer" reads token-balanced micro-batches for two DP ranks once rewards are ready.

Each task pulls rows as soon as the fields it needs are ready; nobody waits for a whole step.
Run: python examples/store_pipeline.py
"""

from __future__ import annotations

import asyncio

import torch

from asyncflow_core import (
    Capacity,
    GroupSampler,
    InProcessDataStore,
    Tags,
    TokenBalancedSampler,
)

GROUP = 4  # samples per prompt
PROMPTS = 32


async def feeder(store: InProcessDataStore) -> None:
    for p in range(PROMPTS):
        prompt = torch.tensor([p % 10, (p // 10) % 10])
        # put() waits here whenever the partition is full (back-pressure), nothing is dropped
        await store.put("rl", {"prompt": [prompt] * GROUP}, tags=[Tags(group=p)] * GROUP)
    await store.close("rl")  # consumers get a final short batch, then end_of_stream


async def rollout(store: InProcessDataStore) -> None:
    gen = torch.Generator().manual_seed(0)
    while True:
        meta = await store.get_meta("rl", "rollout", ["prompt"], 8, sampler=GroupSampler(GROUP))
        if meta.end_of_stream:
            return
        batch = await store.get_data(meta)
        lengths = torch.randint(1, 6, (len(meta),), generator=gen).tolist()
        answers = [batch["prompt"][i].sum().repeat(n) for i, n in enumerate(lengths)]
        await store.put(
            "rl",
            {"response": answers},
            rows=meta.rows,
            tags=[Tags(versions=(0,), tokens=n) for n in lengths],
        )
        await store.ack(meta)


async def reward(store: InProcessDataStore) -> None:
    while True:
        meta = await store.get_meta("rl", "reward", ["prompt", "response"], 4)
        if meta.end_of_stream:
            return
        batch = await store.get_data(meta, layout="list")
        scores = [float(len(r) % 2) for r in batch["response"]]
        await store.put("rl", {"reward": scores}, rows=meta.rows)
        await store.ack(meta)


async def trainer(store: InProcessDataStore) -> list[float]:
    seen: list[float] = []
    while True:
        meta = await store.get_meta(
            "rl", "train", ["response", "reward"], 16, sampler=TokenBalancedSampler(), dp_size=2
        )
        if meta.end_of_stream:
            return seen
        for rank, part in enumerate(meta.split()):
            batch = await store.get_data(part)  # padded tensor + lengths for ragged fields
            tokens = int(batch.lengths["response"].sum())
            print(f"rank {rank}: {len(part)} rows, {tokens} tokens, rewards {batch['reward']}")
            seen += batch["reward"]
        await store.ack(meta)  # every task consumed these rows: the store reclaims them


async def main() -> None:
    store = InProcessDataStore(num_storage_units=2)
    await store.create_partition(
        "rl",
        ["prompt", "response", "reward"],
        tasks=["rollout", "reward", "train"],
        capacity=Capacity(max_rows=64),
    )
    *_, rewards = await asyncio.gather(feeder(store), rollout(store), reward(store), trainer(store))
    stats = await store.stats("rl")
    print(f"trained on {len(rewards)} samples; live rows left: {stats.rows_live}")
    assert len(rewards) == PROMPTS * GROUP and stats.rows_live == 0


if __name__ == "__main__":
    asyncio.run(main())
