"""Weight sync of real RL updates: deltas vs whole messages vs a raw gloo broadcast, side by side.

    .venv/bin/python benchmarks/weight_sync.py --rl-update [--hidden-size 1536 --num-layers 8]
        [--steps 3] [--lr 1e-6] [--hosts both|one|two] [--link-gbit 10]

Two gloo ranks: rank 0 trains a Llama-architecture model (`transformers`' `LlamaForCausalLM`,
fp32 master weights, AdamW at `--lr`, real gradients of the causal-LM loss on random tokens,
one optimizer step per version) and sends its bf16 weights (what an engine loads, ~650 MB at
the defaults) to rank 1 after each step. Per version, interleaved, every way under test moves
the same bytes:
- `raw`: one `dist.broadcast` of the model's bf16 bytes (the reference, also what rank 1
  checks every staged tensor against, byte for byte);
- `full`: our pipeline (`weight_sync.executor.run_plan`: pack, checksum, broadcast, verify,
  stage), whole messages (`transport: broadcast`);
- `delta`: the same through the delta codec (`weight_sync.delta: true`): deltas against the
  previous version, which both ranks hold (each way has its own `BufferPool`, kept from one
  version to the next, and syncs version 0 before the measured ones);
- one host only: `shm`, the default one-host transport (shared memory, nothing copied on a wire).
`--hosts two` runs the ranks in two network namespaces (`tests/cluster/hosts.py`, as the
multi-host test builds them), the link between them shaped to `--link-gbit` (tc's token bucket;
0: the veth pair's memory speed), standing for two nodes over Ethernet; `one` runs both on this
host over loopback. Receivers stage the weights in host memory (`StagingSink`), as an
asynchronous generate rank does: an engine's own load is the same for every way and left out.

Last line: `RESULT delta_vs_raw_full_between_hosts=<raw s / delta s> delta_vs_raw_full_one_host=
<...> full_vs_raw_between_hosts=<raw s / full s> full_vs_raw_one_host=<...> delta_bytes_fraction=
<bytes sent / full bytes> bit_identical=<true|false>` (medians over the measured versions; a
figure of a host mode not run is "nan"). Memory: each rank's delta bases (`delta_base_MB`) in
the table. A benchmark, not a test: read ratios, not seconds.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MB = 1 << 20


def _dims(args):
    from megatron_async_rl.models.dims import ModelDims

    heads = args.hidden_size // 128
    return ModelDims(
        num_layers=args.num_layers, hidden_size=args.hidden_size, num_attention_heads=heads,
        num_query_groups=max(1, heads // 4), head_dim=128, ffn_hidden_size=args.ffn_size,
        vocab_size=args.vocab_size, padded_vocab_size=args.vocab_size, tied_embeddings=False,
        add_qkv_bias=False, qk_layernorm=False,
    )  # fmt: skip


def _model(args, dims):
    import torch
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=dims.vocab_size, hidden_size=dims.hidden_size,
        intermediate_size=dims.ffn_hidden_size, num_hidden_layers=dims.num_layers,
        num_attention_heads=dims.num_attention_heads, num_key_value_heads=dims.num_query_groups,
        head_dim=dims.head_dim, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).float()
    return model, torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)


def _train_step(model, opt, vocab: int, step: int) -> float:
    import torch

    gen = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, vocab, (2, 64), generator=gen)
    loss = model(input_ids=tokens, labels=tokens).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return float(loss)


def _timed(group, fn):
    """Seconds `fn` took on the slower of the two ranks (both start together)."""
    import torch
    import torch.distributed as dist

    dist.barrier(group=group)
    start = time.perf_counter()
    out = fn()
    took = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    dist.all_reduce(took, op=dist.ReduceOp.MAX, group=group)
    return float(took), out


def worker(args) -> None:
    import torch
    import torch.distributed as dist

    from megatron_async_rl.models.names import hf_to_megatron
    from megatron_async_rl.models.shards import stage_state_dict
    from megatron_async_rl.weight_sync import buffers, executor, sinks
    from megatron_async_rl.weight_sync.delta_wire import DeltaBases
    from megatron_async_rl.weight_sync.plan import TrainLayout, build_plan

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://{args.master_addr}:{args.port}",
                            rank=args.rank, world_size=2)  # fmt: skip
    rank, group = args.rank, dist.new_group([0, 1])
    dims = _dims(args)
    plan = build_plan(TrainLayout(offset=0, tp=1, pp=1, dp=1), dims, "bfloat16", 512 * MB,
                      128 * MB)  # fmt: skip
    shapes = dict(plan.hf_shapes)
    offsets, total = {}, 0
    for name, shape in plan.hf_shapes:
        offsets[name] = (total, math.prod(shape) * 2)
        total += math.prod(shape) * 2
    model = opt = None
    if rank == 0:
        model, opt = _model(args, dims)
    ways = ["raw", "full", "delta"] + (["shm"] if args.one_host else [])
    pools = {way: buffers.BufferPool() for way in ways}
    pools["delta"].delta_bases = DeltaBases(full_every=1 << 30)
    raw = torch.empty(total, dtype=torch.uint8)
    rows = []
    for version in range(args.steps + 1):
        loss = None
        local = None
        if rank == 0:
            if version:
                loss = _train_step(model, opt, dims.vocab_size, version)
            params = dict(model.named_parameters())
            hf = {name: params[name].detach().to(torch.bfloat16) for name in shapes}
            for name, (offset, nbytes) in offsets.items():
                raw[offset : offset + nbytes].copy_(hf[name].reshape(-1).view(torch.uint8))
            local = stage_state_dict(hf_to_megatron(hf, dims), dims, tp_rank=0, tp_size=1,
                                     pp_rank=0, pp_size=1)  # fmt: skip
        row = {"version": version, "loss": loss}
        for way in ways:
            if way == "raw":
                row["raw_s"], _ = _timed(group, lambda: dist.broadcast(raw, src=0, group=group))  # noqa: B023
                continue
            counter = buffers.MemoryCounter()
            sink = None
            if rank == 1:
                sink = sinks.StagingSink(plan, counter, version, plan.consume_bytes, pools[way])
            transport = "auto" if way == "shm" else "broadcast"

            def sync(way=way, sink=sink, counter=counter, transport=transport, version=version,
                     local=local):  # fmt: skip
                return executor.run_plan(
                    plan, rank, version, {0: group}, local=local, tp_groups={}, sink=sink,
                    counter=counter, pool=pools[way], transport=transport,
                    bases=pools[way].delta_bases,
                )  # fmt: skip

            row[f"{way}_s"], stats = _timed(group, sync)
            if stats.error is not None:
                raise stats.error
            if way == "delta":
                row["delta_fraction"] = stats.wire_bytes / max(stats.full_bytes, 1)
                row["delta_senders"] = stats.delta_senders
                row["encode_s"], row["decode_s"] = stats.encode_s, stats.decode_s
                row["delta_base_MB"] = pools[way].delta_bases.nbytes / MB
            if sink is not None:  # every staged tensor, byte for byte, against raw's bytes
                row[f"{way}_identical"] = all(
                    torch.equal(sink.weights[n].reshape(-1).view(torch.uint8),
                                raw[o : o + b])  # fmt: skip
                    for n, (o, b) in offsets.items()
                )
        rows.append(row)
    Path(args.out).write_text(json.dumps({"rank": rank, "rows": rows, "bytes": total}))
    dist.destroy_process_group()


# -- the driver -----------------------------------------------------------------------------------


def _worker_argv(args, rank: int, addr: str, port: int, out: Path, one_host: bool) -> list[str]:
    argv = [sys.executable, str(Path(__file__).resolve()), "--worker", "--rank", str(rank),
            "--master-addr", addr, "--port", str(port), "--out", str(out)]  # fmt: skip
    for name in ("hidden_size", "num_layers", "ffn_size", "vocab_size", "steps", "lr"):
        argv += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    return argv + (["--one-host"] if one_host else [])


def _run_pair(args, tmp: Path, hosts=None) -> list[dict]:
    from tests.harness.ports import free_port

    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    addr = hosts.addrs[0] if hosts else "127.0.0.1"
    port = free_port()
    procs = []
    for rank in (0, 1):
        out = tmp / f"rank{rank}.json"
        argv = _worker_argv(args, rank, addr, port, out, one_host=hosts is None)
        log = open(tmp / f"rank{rank}.log", "w")
        if hosts is None:
            procs.append((subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT),
                          log))  # fmt: skip
        else:
            env_h = dict(env, GLOO_SOCKET_IFNAME=hosts.ifaces[rank])
            procs.append((hosts.popen(rank, argv, env_h, stdout=log, stderr=subprocess.STDOUT),
                          log))  # fmt: skip
    codes = [proc.wait(timeout=3600) for proc, _ in procs]
    for _, log in procs:
        log.close()
    if codes != [0, 0]:
        tails = [(tmp / f"rank{r}.log").read_text()[-3000:] for r in (0, 1)]
        raise SystemExit(f"worker exit codes {codes}:\n" + "\n".join(tails))
    return [json.loads((tmp / f"rank{r}.json").read_text()) for r in (0, 1)]


def _shape_link(hosts, gbit: float) -> None:
    """A token-bucket rate limit on both ends of the pair (tc), as a `gbit` Ethernet link."""
    for name, iface in zip(hosts.names, hosts.ifaces, strict=True):
        subprocess.run(["ip", "netns", "exec", name, "tc", "qdisc", "add", "dev", iface, "root",
                        "tbf", "rate", f"{gbit}gbit", "burst", "4mb", "latency", "50ms"],
                       check=True)  # fmt: skip


def _summary(results: list[dict], mode: str) -> dict:
    sender, receiver = results[0]["rows"], results[1]["rows"]
    measured = receiver[1:]  # version 0 fills the pools and bases
    out = {"mode": mode, "GB": results[0]["bytes"] / 1e9}
    for way in ("raw", "full", "delta", "shm"):
        if f"{way}_s" in measured[0]:
            out[f"{way}_s"] = statistics.median(r[f"{way}_s"] for r in measured)
    out["delta_vs_raw"] = statistics.median(r["raw_s"] / r["delta_s"] for r in measured)
    out["full_vs_raw"] = statistics.median(r["raw_s"] / r["full_s"] for r in measured)
    out["delta_fraction"] = statistics.median(r["delta_fraction"] for r in sender[1:])
    out["deltas_sent"] = all(r["delta_senders"] == 1 for r in sender[1:])
    out["identical"] = all(v for r in receiver for k, v in r.items() if k.endswith("_identical"))
    out["losses"] = [r["loss"] for r in sender[1:]]
    out["delta_base_MB"] = (sender[-1]["delta_base_MB"], receiver[-1]["delta_base_MB"])
    out["encode_s"] = statistics.median(r["encode_s"] for r in sender[1:])
    out["decode_s"] = statistics.median(r["decode_s"] for r in measured)
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden-size", type=int, default=1536)
    parser.add_argument("--num-layers", type=int, default=8)
    parser.add_argument("--ffn-size", type=int, default=4096)
    parser.add_argument("--vocab-size", type=int, default=32000)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--lr", type=float, default=1e-6)
    parser.add_argument("--hosts", choices=("both", "one", "two"), default="both")
    parser.add_argument("--link-gbit", type=float, default=10.0)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--one-host", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--master-addr", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args)
        return
    sys.path.insert(0, str(REPO))
    summaries = {}
    with tempfile.TemporaryDirectory(prefix="ws-rl-update-") as tmp:
        if args.hosts in ("both", "one"):
            (Path(tmp) / "one").mkdir()
            summaries["one_host"] = _summary(_run_pair(args, Path(tmp) / "one"), "one host")
        if args.hosts in ("both", "two"):
            from tests.cluster.hosts import TwoHosts

            hosts = TwoHosts(os.getpid() % 1000)
            try:
                if args.link_gbit > 0:
                    _shape_link(hosts, args.link_gbit)
                (Path(tmp) / "two").mkdir()
                results = _run_pair(args, Path(tmp) / "two", hosts)
                summaries["between_hosts"] = _summary(results, "two hosts")
            finally:
                hosts.close()
    link = f"{args.link_gbit:g} Gbit/s link" if args.link_gbit > 0 else "unshaped veth"
    print(f"bf16 model {next(iter(summaries.values()))['GB']:.3f} GB, {args.steps} AdamW steps "
          f"at lr {args.lr:g}; between hosts: {link}")  # fmt: skip
    print(f"{'mode':10} {'raw s':>7} {'full s':>7} {'delta s':>8} {'shm s':>7} {'delta/raw':>9} "
          f"{'full/raw':>8} {'bytes':>6} {'enc s':>6} {'dec s':>6} {'bases MB (s, r)':>16}")
    for s in summaries.values():
        print(f"{s['mode']:10} {s['raw_s']:7.3f} {s['full_s']:7.3f} {s['delta_s']:8.3f} "
              f"{s.get('shm_s', float('nan')):7.3f} {s['delta_vs_raw']:9.2f} "
              f"{s['full_vs_raw']:8.2f} {s['delta_fraction']:6.3f} {s['encode_s']:6.3f} "
              f"{s['decode_s']:6.3f} {s['delta_base_MB'][0]:7.0f},{s['delta_base_MB'][1]:7.0f}")
        print(f"  losses {['%.4f' % x for x in s['losses']]}, deltas sent every version: "
              f"{s['deltas_sent']}, read-back identical: {s['identical']}")
    nan = {"delta_vs_raw": float("nan"), "full_vs_raw": float("nan")}
    two, one = summaries.get("between_hosts", nan), summaries.get("one_host", nan)
    fraction = max(s["delta_fraction"] for s in summaries.values())
    identical = all(s["identical"] and s["deltas_sent"] for s in summaries.values())
    print(f"RESULT delta_vs_raw_full_between_hosts={two['delta_vs_raw']:.3f} "
          f"delta_vs_raw_full_one_host={one['delta_vs_raw']:.3f} "
          f"full_vs_raw_between_hosts={two['full_vs_raw']:.3f} "
          f"full_vs_raw_one_host={one['full_vs_raw']:.3f} "
          f"delta_bytes_fraction={fraction:.4f} bit_identical={str(identical).lower()}")


if __name__ == "__main__":
    main()
