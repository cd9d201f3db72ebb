#!/usr/bin/python3
"""One worker of a small GPT training job, the way Megatron-LM lays one out:
tensor parallelism (column- and row-parallel linears, a SwiGLU MLP whose fc1
holds [gate; up] per rank, grouped-query attention split by query group, a
vocabulary-parallel embedding and output layer with padded rows), pipeline
parallelism (stages as processes passing activations forward and their
gradients back), and data parallelism (gradients all-reduced), or with
fsdp=S in the config FSDP's sharding (HSDP when S < dp): each rank holds
chunk dp_rank % S of every tensor and of Adam's moments, cut on dim 0 as
torch.chunk cuts, gathers the whole tensors from its S-rank shard group
before use, and reduce-scatters the gradients back to their chunks (then
all-reduces them across the dp/S replicas), or with distopt=1 Megatron-Core's
distributed optimizer (ZeRO-1): parameters whole on every dp rank, Adam's
moments of the dp rank's part of the stage's buffer only (parameters in
reverse order, each starting at a multiple of 64 elements, the end padded
to lcm(dp, 128)), gradients reduce-scattered over that buffer and the
updated parameters all-gathered. CPU, float64,
torch.distributed with gloo. Its data and its checkpoints go only through a
Scalai mount: each data-parallel rank reads its samples from
MOUNT/data/NAME/rank-D/, each rank loads MOUNT/ckpt/latest/rank-R/ and, at
the end, the ranks with dp_rank 0 (dp_rank < S under fsdp, every rank
under distopt) save
MOUNT/ckpt/step-N/rank-R/ (Adam's
moments saved per parameter as optimizer.exp_avg.NAME and
optimizer.exp_avg_sq.NAME, so they reshard with it; the iteration and Adam's
step in extra/state.json).

Run one process per rank with RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT
set (scenario.py does)."""
import argparse
import json
import math
import os
import sys
import time

import numpy as np
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "python"))
import scalai  # noqa: E402  the client every worker uses with the mount

DTYPE = torch.float64
ADAM = {"lr": 3e-3, "b1": 0.9, "b2": 0.95, "eps": 1e-8}


def parse_kv(text):
    return {k: v for k, v in (part.split("=") for part in text.split(","))}


# --- the parallel layout -------------------------------------------------------

class Topology:
    """Megatron's rank order: tp fastest, then dp, then pp."""

    def __init__(self, config, rank):
        self.tp, self.pp, self.dp = (int(config[k]) for k in ("tp", "pp", "dp"))
        self.fsdp = int(config.get("fsdp", 1))
        self.distopt = config.get("distopt") == "1"
        self.rank = rank
        self.tp_rank = rank % self.tp
        self.dp_rank = rank // self.tp % self.dp
        self.pp_rank = rank // (self.tp * self.dp)
        self.first = self.pp_rank == 0
        self.last = self.pp_rank == self.pp - 1
        self.tp_group = self.dp_group = self.shard_group = self.replica_group = None
        self.chunk = self.dp_rank % self.fsdp
        # Under fsdp: the S ranks of this rank's run (each a chunk), in chunk
        # order, and the dp/S ranks that hold the same chunk.
        self.shard_ranks = [self.rank_of(self.tp_rank, self.dp_rank - self.chunk + c, self.pp_rank)
                            for c in range(self.fsdp)]
        # Every process makes every group, in the same order.
        for p in range(self.pp):
            for d in range(self.dp):
                ranks = [self.rank_of(t, d, p) for t in range(self.tp)]
                g = dist.new_group(ranks)
                if rank in ranks:
                    self.tp_group = g
        for p in range(self.pp):
            for t in range(self.tp):
                ranks = [self.rank_of(t, d, p) for d in range(self.dp)]
                g = dist.new_group(ranks)
                if rank in ranks:
                    self.dp_group = g
                for first in range(0, self.dp, self.fsdp):
                    g = dist.new_group(ranks[first:first + self.fsdp])
                    if rank in ranks[first:first + self.fsdp]:
                        self.shard_group = g
                for c in range(self.fsdp):
                    g = dist.new_group(ranks[c::self.fsdp])
                    if rank in ranks[c::self.fsdp]:
                        self.replica_group = g

    def rank_of(self, tp_rank, dp_rank, pp_rank):
        return (pp_rank * self.dp + dp_rank) * self.tp + tp_rank

    def peer(self, pp_rank):
        return self.rank_of(self.tp_rank, self.dp_rank, pp_rank)


def stage_layers(layers, pp, pp_rank):
    """The reference's default split: as even as possible, earlier stages take the rest."""
    base, extra = divmod(layers, pp)
    sizes = [base + (1 if p < extra else 0) for p in range(pp)]
    return sum(sizes[:pp_rank]), sizes[pp_rank]


class CopyToTP(torch.autograd.Function):
    """Identity forward; the gradient is summed over the tensor-parallel
    group (the input of a column-parallel linear is replicated)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class ReduceFromTP(torch.autograd.Function):
    """Sum over the tensor-parallel group forward; identity backward (every
    rank uses the sum the same way)."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


# --- the model -----------------------------------------------------------------

def megatron_buffer(params, dp):
    """Where Megatron-Core's distributed optimizer puts each parameter in
    its stage's buffer: [(name, start, numel)] walking the parameters in
    reverse order, each start padded to 64 elements; and the buffer's size,
    padded to lcm(dp, 128)."""
    out, at = [], 0
    for name, numel in reversed(params):
        at = -(-at // 64) * 64
        out.append((name, at, numel))
        at += numel
    multiple = math.lcm(dp, 128)
    return out, -(-at // multiple) * multiple


def chunk_bounds(rows, s, c):
    """torch.chunk's chunk c of s over `rows` rows: ceil(rows/s) each, the
    last ones smaller or empty."""
    size = -(-rows // s)
    return min(rows, c * size), min(rows, (c + 1) * size)


class Stage:
    """This rank's part of the model: its pipeline stage's layers, each
    tensor its tensor-parallel shard, under Megatron-Core's local names.
    Under fsdp it holds its chunk of each (`owned`) and gathers the whole
    tensors into `params` before each step."""

    def __init__(self, m, topo, tensors):
        self.m, self.topo = m, topo
        self.first_layer, self.num_layers = stage_layers(m["layers"], topo.pp, topo.pp_rank)
        self.owned = {name: torch.tensor(arr, dtype=DTYPE)
                      for name, arr in tensors.items() if not name.startswith("optimizer.")}
        # Under distopt: this dp rank's part [lo, hi) of the buffer, and of
        # each parameter that reaches into it, the flat range [a, b) whose
        # moments it holds, at `at` in its part.
        self.ranges = {}
        if topo.distopt:
            self.buffer, size = megatron_buffer([(n, t.numel()) for n, t in self.owned.items()],
                                                topo.dp)
            per = size // topo.dp
            self.lo, self.hi = topo.dp_rank * per, (topo.dp_rank + 1) * per
            for name, start, numel in self.buffer:
                a, b = max(start, self.lo), min(start + numel, self.hi)
                if a < b:
                    self.ranges[name] = (a - start, b - start, a - self.lo)
            held = {n[len("optimizer.exp_avg."):] for n in tensors if n.startswith("optimizer.exp_avg.")}
            assert held == set(self.ranges), (sorted(held), sorted(self.ranges))
        self.exp_avg = {n: torch.tensor(tensors["optimizer.exp_avg." + n], dtype=DTYPE)
                        for n in (self.ranges if topo.distopt else self.owned)}
        self.exp_avg_sq = {n: torch.tensor(tensors["optimizer.exp_avg_sq." + n], dtype=DTYPE)
                           for n in self.exp_avg}
        # The rows of each whole (tp-local) tensor: the chunks' rows summed.
        self.rows = {}
        for name, t in self.owned.items():
            n = torch.tensor([t.shape[0]], dtype=torch.int64)
            if topo.fsdp > 1:
                dist.all_reduce(n, group=topo.shard_group)
            self.rows[name] = int(n.item())
        self.params = {}

    def gather(self):
        """The whole tensors, as leaves that collect gradients: each chunk
        all-gathered from the shard group (padded to the largest chunk)."""
        s = self.topo.fsdp
        for name, t in self.owned.items():
            if s == 1:
                whole = t.clone()
            else:
                rows = self.rows[name]
                size = -(-rows // s)
                padded = torch.zeros((size,) + tuple(t.shape[1:]), dtype=DTYPE)
                padded[:t.shape[0]] = t
                parts = [torch.empty_like(padded) for _ in range(s)]
                dist.all_gather(parts, padded, group=self.topo.shard_group)
                whole = torch.cat([parts[c][:chunk_bounds(rows, s, c)[1] - chunk_bounds(rows, s, c)[0]]
                                   for c in range(s)])
            self.params[name] = whole.requires_grad_()

    def p(self, name):
        return self.params[name]

    def tp_in(self, x):
        return CopyToTP.apply(x, self.topo.tp_group) if self.topo.tp > 1 else x

    def tp_out(self, x):
        return ReduceFromTP.apply(x, self.topo.tp_group) if self.topo.tp > 1 else x

    @staticmethod
    def rms_norm(x, w):
        return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + 1e-6) * w

    def vocab_range(self):
        rows = self.p("embedding.word_embeddings.weight" if self.topo.first
                      else "output_layer.weight").shape[0]
        return self.topo.tp_rank * rows, (self.topo.tp_rank + 1) * rows

    def embed(self, tokens):
        lo, hi = self.vocab_range()
        inside = (tokens >= lo) & (tokens < hi)
        rows = self.p("embedding.word_embeddings.weight")[(tokens - lo).clamp(0, hi - lo - 1)]
        return self.tp_out(rows * inside.unsqueeze(-1))

    def rope(self, x):
        """Rotary position embedding over the last dim of [b, s, heads, hd]."""
        s, hd = x.shape[1], x.shape[-1]
        inv = 1.0 / (10000 ** (torch.arange(0, hd, 2, dtype=DTYPE) / hd))
        ang = torch.arange(s, dtype=DTYPE)[:, None] * inv[None, :]
        cos, sin = ang.cos()[None, :, None, :], ang.sin()[None, :, None, :]
        a, b = x[..., : hd // 2], x[..., hd // 2:]
        return torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1)

    def layer(self, x, n):
        m, pre = self.m, f"decoder.layers.{n}."
        heads, groups = m["heads"], m["groups"]
        hd = m["hidden"] // heads
        per_group = heads // groups
        b, s, _ = x.shape
        # Attention: linear_qkv holds [q of the group's heads; k; v] per query
        # group, and each tensor-parallel rank whole groups of it.
        h = self.tp_in(self.rms_norm(x, self.p(pre + "self_attention.linear_qkv.layer_norm_weight")))
        qkv = h @ self.p(pre + "self_attention.linear_qkv.weight").T
        local_groups = qkv.shape[-1] // ((per_group + 2) * hd)
        qkv = qkv.view(b, s, local_groups, per_group + 2, hd)
        q = qkv[:, :, :, :per_group].reshape(b, s, local_groups * per_group, hd)
        k = qkv[:, :, :, per_group:per_group + 1].expand(-1, -1, -1, per_group, -1)
        v = qkv[:, :, :, per_group + 1:].expand(-1, -1, -1, per_group, -1)
        k = k.reshape(b, s, local_groups * per_group, hd)
        v = v.reshape(b, s, local_groups * per_group, hd)
        q, k = self.rope(q), self.rope(k)
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(hd)
        causal = torch.ones(s, s, dtype=torch.bool).triu(1)
        scores = scores.masked_fill(causal, float("-inf"))
        att = torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v).reshape(b, s, -1)
        x = x + self.tp_out(att @ self.p(pre + "self_attention.linear_proj.weight").T)
        # SwiGLU: this rank's fc1 rows are [gate_t; up_t].
        h = self.tp_in(self.rms_norm(x, self.p(pre + "mlp.linear_fc1.layer_norm_weight")))
        gate, up = (h @ self.p(pre + "mlp.linear_fc1.weight").T).chunk(2, dim=-1)
        act = torch.nn.functional.silu(gate) * up
        return x + self.tp_out(act @ self.p(pre + "mlp.linear_fc2.weight").T)

    def loss_sum(self, x, labels):
        """Sum of the token losses, by a vocabulary-parallel cross entropy
        that leaves the padding rows out (so they stay zero)."""
        h = self.tp_in(self.rms_norm(x, self.p("decoder.final_layernorm.weight")))
        logits = h @ self.p("output_layer.weight").T
        lo, hi = self.vocab_range()
        padding = torch.arange(lo, hi) >= self.m["vocab"]
        logits = logits.masked_fill(padding, float("-inf"))
        top = logits.max(-1).values.detach()
        if self.topo.tp > 1:
            dist.all_reduce(top, op=dist.ReduceOp.MAX, group=self.topo.tp_group)
        total = self.tp_out(torch.exp(logits - top.unsqueeze(-1)).sum(-1))
        inside = (labels >= lo) & (labels < hi)
        picked = logits.gather(-1, (labels - lo).clamp(0, hi - lo - 1).unsqueeze(-1)).squeeze(-1)
        target = self.tp_out(torch.where(inside, picked, torch.zeros_like(picked)))
        return (torch.log(total) + top - target).sum()

    def step(self, tokens, labels, tokens_in_batch, act_shape):
        """One forward and backward through the pipeline; returns this dp
        rank's share of the loss on the last stage, else None."""
        topo = self.topo
        if topo.first:
            x_in = None
            x = self.embed(tokens)
        else:
            x_in = torch.empty(act_shape, dtype=DTYPE)
            dist.recv(x_in, src=topo.peer(topo.pp_rank - 1))
            x_in.requires_grad_()
            x = x_in
        for n in range(self.num_layers):
            x = self.layer(x, n)
        loss = None
        if topo.last:
            loss = self.loss_sum(x, labels) / tokens_in_batch
            loss.backward()
        else:
            dist.send(x.detach(), dst=topo.peer(topo.pp_rank + 1))
            grad = torch.empty(act_shape, dtype=DTYPE)
            dist.recv(grad, src=topo.peer(topo.pp_rank + 1))
            x.backward(grad)
        if not topo.first:
            dist.send(x_in.grad, dst=topo.peer(topo.pp_rank - 1))
        return loss

    def chunk_grad(self, name):
        """This rank's chunk of the gradient summed over every dp rank: a
        reduce-scatter in the shard group (gloo has none: one reduce per
        chunk, to the chunk's holder), then an all-reduce across replicas."""
        g, topo = self.params[name].grad, self.topo
        if topo.fsdp == 1:
            if topo.dp > 1:
                dist.all_reduce(g, group=topo.dp_group)
            return g
        mine = None
        for c in range(topo.fsdp):
            lo, hi = chunk_bounds(self.rows[name], topo.fsdp, c)
            part = g[lo:hi].contiguous()
            dist.reduce(part, dst=topo.shard_ranks[c], group=topo.shard_group)
            if c == topo.chunk:
                mine = part
        if topo.dp > topo.fsdp:
            dist.all_reduce(mine, group=topo.replica_group)
        return mine

    def adam_distopt(self, t):
        """ZeRO-1 as Megatron-Core does it: the gradients, flattened into
        the buffer, reduce-scattered over the dp ranks (gloo has no
        reduce-scatter: one reduce per part, to its owner); Adam on this
        rank's part; the updated parts all-gathered back into every
        parameter."""
        topo = self.topo
        size = self.hi - self.lo
        grads = torch.zeros(size * topo.dp, dtype=DTYPE)
        for name, start, numel in self.buffer:
            grads[start:start + numel] = self.params[name].grad.reshape(-1)
        mine = grads[self.lo:self.hi].clone()
        if topo.dp > 1:
            for r in range(topo.dp):
                part = grads[r * size:(r + 1) * size].clone()
                dist.reduce(part, dst=topo.rank_of(topo.tp_rank, r, topo.pp_rank),
                            group=topo.dp_group)
                if r == topo.dp_rank:
                    mine = part
        updated = torch.zeros(size, dtype=DTYPE)
        for name, (a, b, at) in self.ranges.items():
            g = mine[at:at + b - a]
            m, v = self.exp_avg[name], self.exp_avg_sq[name]
            m.mul_(ADAM["b1"]).add_(g, alpha=1 - ADAM["b1"])
            v.mul_(ADAM["b2"]).addcmul_(g, g, value=1 - ADAM["b2"])
            mhat = m / (1 - ADAM["b1"] ** t)
            vhat = v / (1 - ADAM["b2"] ** t)
            p = self.owned[name].reshape(-1)[a:b].clone()
            p -= ADAM["lr"] * mhat / (vhat.sqrt() + ADAM["eps"])
            updated[at:at + b - a] = p
        parts = [torch.empty(size, dtype=DTYPE) for _ in range(topo.dp)]
        if topo.dp > 1:
            dist.all_gather(parts, updated, group=topo.dp_group)
        else:
            parts = [updated]
        whole = torch.cat(parts)
        for name, start, numel in self.buffer:
            self.owned[name] = whole[start:start + numel].reshape(self.owned[name].shape).clone()
        self.params = {}

    def adam(self, t):
        if self.topo.distopt:
            return self.adam_distopt(t)
        for name, p in self.owned.items():
            g = self.chunk_grad(name)
            m, v = self.exp_avg[name], self.exp_avg_sq[name]
            m.mul_(ADAM["b1"]).add_(g, alpha=1 - ADAM["b1"])
            v.mul_(ADAM["b2"]).addcmul_(g, g, value=1 - ADAM["b2"])
            mhat = m / (1 - ADAM["b1"] ** t)
            vhat = v / (1 - ADAM["b2"] ** t)
            p -= ADAM["lr"] * mhat / (vhat.sqrt() + ADAM["eps"])
        self.params = {}

    def tensors(self):
        out = {}
        for name, p in self.owned.items():
            out[name] = p.numpy()
            if name not in self.exp_avg:  # another dp rank's, under distopt
                continue
            out["optimizer.exp_avg." + name] = self.exp_avg[name].numpy()
            out["optimizer.exp_avg_sq." + name] = self.exp_avg_sq[name].numpy()
        return out


# --- the job -------------------------------------------------------------------

def samples_per_batch(batch, dp, dp_rank):
    """The reference's slice: the first B % dp ranks take one sample more."""
    return batch // dp + (1 if dp_rank < batch % dp else 0)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mount", required=True)
    ap.add_argument("--config", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--dataset", required=True)
    ap.add_argument("--iterations", type=int, required=True)
    ap.add_argument("--save", action="store_true")
    ap.add_argument("--log", required=True)
    args = ap.parse_args()
    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=world)
    topo = Topology(parse_kv(args.config), rank)
    m = {k: int(v) for k, v in parse_kv(args.model).items()}
    mnt = args.mount

    # Load this rank's shard of the newest step, and where the job stands.
    ckpt = f"{mnt}/ckpt/latest/rank-{rank:05d}"
    shard = scalai.load_shard(mnt, rank, device=None)
    tensors = {name: np.array(x) for name, x in shard.items()}  # owned copies
    meta = shard.metadata
    assert meta["scalai.config"] == args.config, (meta, args.config)
    step = int(meta["scalai.step"])
    try:
        with open(f"{ckpt}/extra/state.json") as f:
            state = json.load(f)  # from the saved rank this rank maps to
    except FileNotFoundError:  # the imported initial model has none
        state = {"iteration": step, "adam_step": step}
    assert state["iteration"] == step, (state, meta)
    stage = Stage(m, topo, tensors)
    if topo.distopt:
        # The mount's rank.json places each part of the moments as this
        # worker's own reading of Megatron's rule does.
        with open(f"{ckpt}/rank.json") as f:
            placed = json.load(f)["tensors"]
        for name, (a, b, at) in stage.ranges.items():
            info = placed["optimizer.exp_avg." + name]
            assert (info["flat_begin"], info["bucket_offset"], info["shape"]) == (a, at, [b - a]), \
                (name, info, (a, b, at))

    samples = scalai.RankSamples(mnt, args.dataset, rank)
    assert samples.dp_rank == topo.dp_rank, (samples.dp_rank, topo.dp_rank)
    info = samples.info
    batch = info["global_batch"]
    assert info["position"] == state["iteration"] * batch, (info, state)
    mine = samples_per_batch(batch, topo.dp, topo.dp_rank)
    ids = samples.sample_ids
    seq = m["seq"]
    log = open(args.log, "a") if topo.last and topo.tp_rank == 0 and topo.dp_rank == 0 else None

    for j in range(args.iterations):
        iteration = state["iteration"] + j
        rows = [samples[k] for k in range(j * mine, (j + 1) * mine)]
        sample = torch.from_numpy(np.stack(rows).astype(np.int64))
        stage.gather()
        loss = stage.step(sample[:, :-1], sample[:, 1:], batch * seq, (mine, seq, m["hidden"]))
        stage.adam(state["adam_step"] + j + 1)
        if topo.last:
            total = loss.detach().clone()
            if topo.dp > 1:
                dist.all_reduce(total, group=topo.dp_group)
            used = [None] * topo.dp
            dist.all_gather_object(used, ids[j * mine:(j + 1) * mine].tolist(), group=topo.dp_group)
            if log:
                log.write(json.dumps({"iteration": iteration + 1, "config": args.config,
                                      "loss": total.item(),
                                      "sample_ids": [i for part in used for i in part]}) + "\n")
                log.flush()

    done = state["iteration"] + args.iterations
    if args.save:
        dist.barrier()
        if topo.dp_rank < topo.fsdp or topo.distopt:
            state_json = json.dumps({"iteration": done,
                                     "adam_step": state["adam_step"] + args.iterations,
                                     "saved_under": args.config})
            scalai.save_shard(mnt, done, rank, stage.tensors(),
                              extra={"state.json": state_json},
                              consumed_samples=done * batch if rank == 0 else None)
        dist.barrier()
        if rank == 0:
            # On a host of a cluster the step commits once every host's
            # part is saved, a beat or two after the last close.
            deadline = time.time() + 60
            while os.readlink(f"{mnt}/ckpt/latest") != f"step-{done:08d}":
                assert time.time() < deadline, open(f"{mnt}/status").read()
                time.sleep(0.02)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
