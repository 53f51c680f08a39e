"""``asyncflow_tq`` beyond the shared scenario: bad input (a clear error naming the field, and
nothing changed), a blocking fetch that waits for data, samplers (GRPO groups, a sampler
written for TransferQueue), the async API, overwrites and clears freeing the store's rows,
batches across partitions, the metadata classes, and several threads sharing a client."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch

pytest.importorskip("tensordict", reason="the TransferQueue facade needs the [tq] extra")
import asyncflow_tq as tq
from asyncflow_tq import BatchMeta, GRPOGroupNSampler, KVBatchMeta
from tensordict import TensorDict


@pytest.fixture
def q() -> Iterator[Any]:
    tq.init({"backend": {"storage_backend": "InProcess"}, "controller": {"polling_mode": True}})
    try:
        yield tq.get_client()
    finally:
        tq.close()


def td(n: int, **cols: Any) -> Any:
    if not cols:
        cols = {"x": torch.arange(n * 2, dtype=torch.float32).reshape(n, 2)}
    return TensorDict(cols, batch_size=n)


def store_partitions(c: Any) -> list[str]:
    return list(c.store.controller.partitions())


# ----------------------------------------------------------------------------------------------
# bad input
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("conf", "field"),
    [
        ({"controller": {"polling_mode": "yes"}}, "controller.polling_mode"),
        ({"controller": {"sampler": "NoSuchSampler"}}, "NoSuchSampler"),
        ({"controller": {"get_meta_timeout_s": -1}}, "controller.get_meta_timeout_s"),
        ({"backend": {"storage_backend": "Yuanrong"}}, "backend.storage_backend"),
        (
            {"backend": {"SimpleStorage": {"num_data_storage_units": 0}}},
            "num_data_storage_units",
        ),
        ({"backend": {"SimpleStorage": {"copy_on_put": 1}}}, "copy_on_put"),
    ],
)
def test_bad_config_names_the_field_and_initialises_nothing(conf: Any, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        tq.init(conf)
    with pytest.raises(RuntimeError, match="init"):
        tq.get_client()


def test_bad_put_changes_nothing(q: Any) -> None:
    with pytest.raises(ValueError, match="data must be a TensorDict"):
        q.put({"x": torch.ones(2, 2)}, partition_id="p")
    with pytest.raises(ValueError, match="partition_id"):
        q.put(td(2))
    with pytest.raises(ValueError, match="partition_id"):
        q.put(td(2), partition_id="")
    meta = q.put(td(3), partition_id="p")
    with pytest.raises(ValueError, match="batch size 2, metadata has 3"):
        q.put(td(2, y=torch.ones(2)), metadata=meta)
    ragged = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)], layout=torch.jagged)
    bad = TensorDict({"x": torch.ones(3, 2)}, batch_size=3)
    bad.set_non_tensor("obj", object())
    with pytest.raises(ValueError, match="'obj'"):
        q.put(bad, partition_id="p")
    assert q.get_partition_list() == ["p"]
    # no index was taken by the rejected puts: the next one continues at 3
    assert q.put(td(2, r=ragged), partition_id="p").global_indexes == [3, 4]
    assert q.get_production_status(["y"], "p") == (None, None)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"batch_size": 0}, "batch_size"),
        ({"batch_size": True}, "batch_size"),
        ({"mode": "peek"}, "mode"),
        ({"task_name": None}, "task_name"),
        ({"data_fields": "x,y"}, None),  # a str is one field name, as a list of one
        ({"data_fields": [1]}, "data_fields"),
        ({"partition_id": ""}, "partition_id"),
        ({"sampling_config": [1]}, "sampling_config"),
    ],
)
def test_bad_get_meta_names_the_field_and_consumes_nothing(
    q: Any, kwargs: dict[str, Any], field: str | None
) -> None:
    q.put(td(4), partition_id="p")
    args = {"data_fields": ["x"], "batch_size": 2, "partition_id": "p", "task_name": "t"}
    args.update(kwargs)
    if field is None:
        assert q.get_meta(**args).size == 0  # no field "x,y": nothing ready
    else:
        with pytest.raises(ValueError, match=field) as err:
            q.get_meta(**args)
        assert isinstance(err.value, RuntimeError)  # what TransferQueue's controller raises
    assert q.get_consumption_status("t", "p")[1].tolist() == [0, 0, 0, 0]


def test_bad_kv_calls_change_nothing(q: Any) -> None:
    tq.kv_batch_put(keys=["a", "b"], partition_id="kv", fields=td(2), tags=[{"i": 0}, {"i": 1}])
    before = tq.kv_list()
    with pytest.raises(ValueError, match="tags"):
        tq.kv_batch_put(keys=["c", "d"], partition_id="kv", tags=[{}])
    with pytest.raises(ValueError, match="tags"):
        tq.kv_batch_put(keys=["c"], partition_id="kv", tags=["not a dict"])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="nested"):
        ragged = torch.nested.nested_tensor([torch.ones(2)], layout=torch.jagged)
        tq.kv_put(key="c", partition_id="kv", fields={"x": ragged})
    with pytest.raises(ValueError, match="fields must be a TensorDict"):
        tq.kv_batch_put(keys=["c"], partition_id="kv", fields={"x": torch.ones(1, 2)})
    with pytest.raises(ValueError, match="duplicates"):
        tq.kv_batch_put(keys=["c", "c"], partition_id="kv", tags=[{}, {}])
    with pytest.raises(TypeError, match="key must be a str"):
        tq.kv_put(key=3, partition_id="kv", tag={})  # type: ignore[arg-type]
    assert tq.kv_list() == before


# ----------------------------------------------------------------------------------------------
# waiting, samplers
# ----------------------------------------------------------------------------------------------
def test_blocking_fetch_waits_for_a_put_then_times_out() -> None:
    tq.init(
        {"backend": {"storage_backend": "InProcess"}, "controller": {"get_meta_timeout_s": 120.0}}
    )
    try:
        c = tq.get_client()
        got: list[Any] = []
        consumer = threading.Thread(
            target=lambda: got.append(c.get_meta(["x"], 3, "p", task_name="t")), daemon=True
        )
        consumer.start()
        c.put(td(2), partition_id="p")  # 2 < 3: the consumer keeps waiting
        c.put(td(2), partition_id="p")
        consumer.join(timeout=60)
        assert not consumer.is_alive() and got[0].global_indexes == [0, 1, 2]
    finally:
        tq.close()
    tq.init(
        {"backend": {"storage_backend": "InProcess"}, "controller": {"get_meta_timeout_s": 0.05}}
    )
    try:
        tq.get_client().put(td(1), partition_id="p")
        with pytest.raises(RuntimeError, match=r"timed out.*1 are ready"):
            tq.get_client().get_meta(["x"], 2, "p", task_name="t")
    finally:
        tq.close()


def test_grpo_sampler_hands_out_whole_consecutive_groups() -> None:
    s = GRPOGroupNSampler(n_samples_per_prompt=3)
    assert s.sample([0, 1, 3, 4, 6, 7], 6) == ([], [])
    assert s.sample([0, 1, 3, 4, 5, 6, 7, 9, 10, 11], 6) == ([3, 4, 5, 9, 10, 11],) * 2
    with pytest.raises(ValueError, match="multiple"):
        s.sample([0, 1, 2], 4)
    with pytest.raises(ValueError, match="n_samples_per_prompt"):
        GRPOGroupNSampler(0)
    # ranks of one DP group asking for the same batch_index get the same batch
    first = s.sample([0, 1, 2, 3, 4, 5], 3, "t", "p", dp_rank=0, batch_index=0)
    assert s.sample([3, 4, 5], 3, "t", "p", dp_rank=0, batch_index=0) == first
    assert s.has_cached_result("p", "t", {"dp_rank": 0, "batch_index": 0})

    tq.init(
        {
            "backend": {"storage_backend": "InProcess"},
            "controller": {"sampler": GRPOGroupNSampler(2), "polling_mode": True},
        }
    )
    try:
        c = tq.get_client()
        meta = c.put(td(5), partition_id="p")  # 0..4
        c.clear_samples(meta[1:2])  # sample 1 gone: groups are (2,3), then (4, -)
        assert c.get_meta(["x"], 2, "p", task_name="t").global_indexes == [2, 3]
        assert c.get_meta(["x"], 2, "p", task_name="t").size == 0
    finally:
        tq.close()


class EveryOtherSampler(tq.BaseSampler):
    """A sampler written against TransferQueue's convention: hands out every other ready
    sample and marks only those consumed; reads the partition view it is given."""

    def sample(
        self, ready_indexes: list[int], batch_size: int, *args: Any, **kwargs: Any
    ) -> tuple[list[int], list[int]]:
        assert isinstance(kwargs["partition"], tq.PartitionView)
        chosen = ready_indexes[::2][:batch_size]
        return chosen, chosen


def test_custom_sampler_class_and_sampling_config() -> None:
    tq.init(
        {
            "backend": {"storage_backend": "InProcess"},
            "controller": {"sampler": EveryOtherSampler, "polling_mode": True},
        }
    )
    try:
        c = tq.get_client()
        c.put(td(6), partition_id="p")
        assert c.get_meta(["x"], 2, "p", task_name="t").global_indexes == [0, 2]
        assert c.get_meta(["x"], 2, "p", task_name="t").global_indexes == [1, 4]
    finally:
        tq.close()


# ----------------------------------------------------------------------------------------------
# async API, threads
# ----------------------------------------------------------------------------------------------
def test_async_api_from_a_user_loop(q: Any) -> None:
    async def main() -> Any:
        meta = await q.async_put(td(4), partition_id="p")
        got = await q.async_get_meta(["x"], 4, "p", task_name="t")
        data = await q.async_get_data(got)
        await tq.async_kv_batch_put(keys=["a"], partition_id="kv", fields=td(1), tags=[{"s": 1}])
        kv = await tq.async_kv_batch_get(keys="a", partition_id="kv")
        listed = await tq.async_kv_list()
        await tq.async_kv_clear(keys="a", partition_id="kv")
        done = await q.async_check_consumption_status("t", "p")
        return meta, data, kv, listed, done

    meta, data, kv, listed, done = asyncio.run(main())
    assert meta.global_indexes == [0, 1, 2, 3]
    assert torch.equal(data["x"].values().reshape(4, 2), td(4)["x"])
    assert kv["x"].values().tolist() == [0.0, 1.0]
    assert listed["kv"] == {"a": {"s": 1}} and done is True
    assert tq.kv_list("kv") == {"kv": {}}


def test_threads_share_a_client(q: Any) -> None:
    errors: list[BaseException] = []

    def work(pid: str) -> None:
        try:
            for i in range(5):
                q.put(td(2, x=torch.full((2, 3), float(i))), partition_id=pid)
            meta = q.get_meta(["x"], 10, pid, task_name="t")
            assert q.get_data(meta)["x"].values().reshape(10, 3)[:, 0].tolist() == [
                float(i) for i in range(5) for _ in range(2)
            ]
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=work, args=(f"p{k}",)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors and not any(t.is_alive() for t in threads)
    assert sorted(q.get_partition_list()) == ["p0", "p1", "p2", "p3"]


# ----------------------------------------------------------------------------------------------
# storage: overwrites and clears free the store's rows
# ----------------------------------------------------------------------------------------------
def test_overwrite_and_clear_free_store_rows(q: Any) -> None:
    meta = q.put(td(3, a=torch.zeros(3, 2), b=torch.ones(3)), partition_id="p")
    assert len(store_partitions(q)) == 1  # fields written together share one store partition
    q.put(td(3, a=torch.full((3, 2), 5.0), b=torch.full((3,), 6.0)), metadata=meta)  # in place
    assert len(store_partitions(q)) == 1
    q.put(td(3, a=torch.full((3, 2), 7.0)), metadata=meta)  # "a" moves to its own columns
    assert len(store_partitions(q)) == 2
    got = q.get_data(q.get_meta(["a", "b"], 3, "p", task_name="t"))
    assert got["a"].values().tolist() == [7.0] * 6 and got["b"].tolist() == [6.0] * 3
    q.put(td(3, b=torch.full((3,), 8.0)), metadata=meta)  # no live cell left in the first
    assert len(store_partitions(q)) == 2  # ... so it was deleted; "b" has its own now
    q.clear_samples(meta[0:2])
    stats = [asyncio.run(q.store.stats(p)) for p in store_partitions(q)]
    assert sorted(s.rows_live for s in stats) == [1, 1]
    with pytest.raises(KeyError, match="sample 0"):
        q.get_data(BatchMeta([0], ["p"], {"a": {}}, [1]))
    q.clear_partition("p")
    assert store_partitions(q) == [] and q.get_partition_list() == []


def test_kv_clear_frees_everything(q: Any) -> None:
    keys = [f"k{i}" for i in range(6)]
    tq.kv_batch_put(keys=keys, partition_id="kv", fields=td(6))
    tq.kv_clear(keys=keys[:3], partition_id="kv")
    assert asyncio.run(q.store.stats(store_partitions(q)[0])).rows_live == 3
    tq.kv_clear(keys=keys[3:], partition_id="kv")
    assert store_partitions(q) == []
    assert tq.kv_list() == {"kv": {}}


def test_batch_across_partitions_and_value_kinds(q: Any) -> None:
    ragged = torch.nested.nested_tensor([torch.ones(1, 3), torch.zeros(4, 3)], layout=torch.jagged)
    a = q.put(TensorDict({"r": ragged, "s": ["u", "v"]}, batch_size=2), partition_id="a")
    b = q.put(
        TensorDict(
            {"r": torch.nested.nested_tensor([torch.ones(2, 3)], layout=torch.jagged), "s": ["w"]},
            batch_size=1,
        ),
        partition_id="b",
    )
    both = BatchMeta.concat([b, a])
    assert both.partition_ids == ["b", "a", "a"]
    got = q.get_data(both)
    assert [t.shape[0] for t in got["r"].unbind()] == [2, 1, 4]
    assert got["s"].tolist() == ["w", "u", "v"]


# ----------------------------------------------------------------------------------------------
# metadata classes
# ----------------------------------------------------------------------------------------------
def test_batch_meta_operations() -> None:
    m = BatchMeta(
        [5, 6, 7, 8, 9],
        ["p"] * 5,
        {"x": {"dtype": torch.float32}},
        [1, 1, 1, 1, 1],
        custom_meta=[{"i": i} for i in range(5)],
    )
    assert [c.global_indexes for c in m.chunk(2)] == [[5, 6, 7], [8, 9]]
    assert m[-1].global_indexes == [9] and m[1:3].custom_meta == [{"i": 1}, {"i": 2}]
    assert BatchMeta.concat(m.chunk(3)).global_indexes == m.global_indexes
    m.reorder([4, 3, 2, 1, 0])
    assert m.global_indexes == [9, 8, 7, 6, 5] and m.custom_meta[0] == {"i": 4}
    assert m.is_ready and not BatchMeta.empty().is_ready
    assert m.select_fields(["x", "nope"]).field_names == ["x"]
    with pytest.raises(ValueError, match="duplicates"):
        m.reorder([0, 0, 1, 2, 3])
    with pytest.raises(ValueError, match="custom_meta has 1"):
        m.update_custom_meta([{}])
    with pytest.raises(IndexError):
        m[5]
    with pytest.raises(ValueError, match="partition_ids has 1"):
        BatchMeta([1, 2], ["p"])


def test_kv_batch_meta_operations() -> None:
    k = KVBatchMeta(keys=["a", "b", "c"], tags=[{"n": 0}, {"n": 1}, {"n": 2}], partition_id="p")
    assert [c.keys for c in k.chunk(2)] == [["a", "b"], ["c"]]
    assert KVBatchMeta.concat(k.chunk(2)).keys == ["a", "b", "c"]
    assert k.select_keys(["c", "a"]).tags == [{"n": 2}, {"n": 0}]
    with pytest.raises(RuntimeError, match="not in this batch"):
        k.select_keys(["z"])
    with pytest.raises(ValueError, match="same length"):
        KVBatchMeta(keys=["a"], tags=[])
    with pytest.raises(ValueError, match="duplicates"):
        KVBatchMeta(keys=["a", "a"], tags=[{}, {}])


def test_a_field_may_change_dtype_and_rank(q: Any) -> None:
    meta = q.put(td(2, x=torch.ones(2, 3)), partition_id="p")
    q.put(td(2, x=torch.arange(2, dtype=torch.int64)), metadata=meta)  # rank and dtype change
    got = q.get_data(q.get_meta(["x"], 2, "p", task_name="t"))
    assert got["x"].dtype == torch.int64 and got["x"].tolist() == [0, 1]
    assert len(store_partitions(q)) == 1  # the float columns held nothing live: deleted
    assert q.put(td(2, x=torch.ones(2, 4)), partition_id="p").global_indexes == [2, 3]


def test_init_takes_an_omegaconf_config_and_returns_the_merged_one() -> None:
    omegaconf = pytest.importorskip("omegaconf", reason="OmegaConf comes with [tq-bench]")
    conf = omegaconf.OmegaConf.create(
        {
            "controller": {"polling_mode": True},
            "backend": {"SimpleStorage": {"num_data_storage_units": 3}},
        }
    )
    merged = tq.init(conf)
    try:
        assert merged["controller"]["polling_mode"] is True
        assert merged["controller"]["sampler"] == "SequentialSampler"
        assert merged["backend"]["SimpleStorage"]["num_data_storage_units"] == 3
        assert len(tq.get_client().store.units) == 3  # type: ignore[attr-defined]
        assert tq.init({"controller": {"polling_mode": False}}) == {
            "controller": {"polling_mode": False}
        }  # already initialised: conf returned as given, nothing changed
        assert tq.get_client().get_meta(["x"], 1, "p", task_name="t").size == 0  # still polling
    finally:
        tq.close()


def test_make_client_and_use_client_switch_the_module_api() -> None:
    a = tq.make_client({"controller": {"polling_mode": True}})
    b = tq.make_client({"controller": {"polling_mode": True}})
    try:
        assert tq.use_client(a) is None
        tq.kv_put(key="k", partition_id="p", tag={"on": "a"})
        assert tq.use_client(b) is a
        assert tq.kv_list() == {}
        tq.use_client(a)
        assert tq.kv_list() == {"p": {"k": {"on": "a"}}}
        with pytest.raises(ValueError, match="TransferQueueClient"):
            tq.use_client("a")  # type: ignore[arg-type]
    finally:
        tq.use_client(None)
        a.close()
        b.close()
    with pytest.raises(RuntimeError, match="closed"):
        a.get_partition_list()


def test_a_batch_whose_fields_sit_in_several_store_partitions(q: Any) -> None:
    meta = q.put(td(4, a=torch.arange(4.0), b=torch.zeros(4)), partition_id="p")
    q.put(td(2, b=torch.tensor([7.0, 8.0])), metadata=meta[1:3])  # b of samples 1, 2 move
    got = q.get_data(q.get_meta(["a", "b"], 4, "p", task_name="t"))
    assert got["a"].tolist() == [0.0, 1.0, 2.0, 3.0]
    assert got["b"].tolist() == [0.0, 7.0, 8.0, 0.0]
    both = BatchMeta.concat([meta[3:4], meta[0:2]])  # out of order
    assert q.get_data(both)["b"].tolist() == [0.0, 0.0, 7.0]


def test_rank_aware_sampler_gives_a_dp_group_the_same_batch() -> None:
    tq.init(
        {
            "backend": {"storage_backend": "InProcess"},
            "controller": {"sampler": "RankAwareSampler", "polling_mode": True},
        }
    )
    try:
        c = tq.get_client()
        c.put(td(6), partition_id="p")

        def ask(rank: int, step: int) -> list[int]:
            cfg = {"dp_rank": rank, "batch_index": step, "task_name": "t", "partition_id": "p"}
            return list(
                c.get_meta(["x"], 2, "p", task_name="t", sampling_config=cfg).global_indexes
            )

        assert ask(0, 0) == [0, 1]
        assert ask(0, 0) == [0, 1]  # a second rank of DP group 0, same step: the same batch
        assert ask(1, 0) == [2, 3]  # another DP group takes the next samples
        assert ask(0, 1) == [4, 5]
        assert ask(1, 1) == []  # nothing left for group 1's second step
        with pytest.raises(RuntimeError, match=r"sampler refused.*dp_rank"):
            c.get_meta(["x"], 1, "p", task_name="u", sampling_config={"dp_rank": -1})
        done = c.get_consumption_status("u", "p")[1]
        assert done is not None and done.tolist() == [0] * 6  # nothing consumed
    finally:
        tq.close()
