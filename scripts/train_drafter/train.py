#!/usr/bin/env python3
"""Trains a DFlash2 drafter on data.py's cache; resumable; writes the drafter in z-lab's format.

Each step takes --batch cached sequences (the least-drawn first, so that every page is drawn once
before any is drawn twice and new pages come first) and --anchors random anchor positions in each
sequence's output; every anchor's block [anchor, mask x (B - 1)] is trained in parallel under one
mask: the block sees the context strictly before its anchor and itself (bidirectionally), never the
other blocks.
Loss: cross-entropy at block positions k = 1 .. B-1 weighted exp(-(k - 1) / gamma), plus the
selector's K-way cross-entropy over the top-K candidates of each position (the gold token put in the
last slot when missing), its predecessor being the gold token before it (the anchor at k = 1).
AdamW with linear warmup and cosine decay over --steps. The run directory holds ckpt.pt (model,
optimizer, step, RNG), log.jsonl and drafter/ (config.json + model.safetensors, rewritten at every
checkpoint); a rerun with the same --out resumes from ckpt.pt; --init DIR starts from a drafter's
weights (e.g. a run's drafter/ carried to another machine, to go on over new pages). Shards that
data.py adds while training runs are picked up every RELOAD_EVERY steps. Several caches (--data DIR
DIR ..., e.g. of data.py processes with other --seed values) train as one.

    python scripts/train_drafter/train.py --target python/ocria_rt/models/ocria-mini --data runs/d/data \
        --out runs/d --steps 3000 --minutes 25

--device cuda trains on a GPU (the cache stays in host memory; each step's batch is copied over).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from data import SHARD_PAGES, read_cache, shard_files  # noqa: E402
from model import DFlash2Drafter, DrafterSpec  # noqa: E402

GAMMA = {16: 7.0, 10: 5.0, 8: 4.0}  # SpecForge's decay per block size; else B / 2
# Steps between looks for shards data.py has added meanwhile. Picked up only at checkpoints (every 500
# steps), a 5-minute GPU run trained on its first 80 pages alone and learned them by heart (train
# tau 12.2, held-out top-1 2%; bench/results/h100-drafter-memorized).
RELOAD_EVERY = 20
# MAX_REUSE_NOTE: a drafter learns the pages it sees many times instead of the target. On the CPU, 480
# pages drawn 20 times each (batch 4, block 8) gave top-1 0.47 at k = 1 on those pages and 0.13 on
# held-out ones; 5,280 pages drawn ~23 times each held out as well as they trained. On a GPU the
# drafter trains far faster than data.py adds pages, and uniform draws over a growing cache drew its
# first pages far more often than the average: at batch 256 for 7 minutes each page was drawn ~100
# times (top-1 0.90 on the batches, 0.06 held out; bench/results/h100-drafter-batch256), and an
# average of 20 was not enough either (bench/results/h100-drafter-reuse20). Hence: the least-drawn
# pages first, no page past --max-reuse, and several data.py processes (pipeline.sh's PRODUCERS).


def target_tables(target: Path) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict]:
    """The target's input embedding and LM head (fp32; tied when it has no lm_head.weight), the scale of its
    final norm (Qwen3.5's norms multiply by 1 + w) and its text config."""
    from safetensors import safe_open

    cfg = json.loads((target / "config.json").read_text())
    text = cfg.get("text_config", cfg)
    with safe_open(str(target / "model.safetensors"), "pt") as f:
        keys = list(f.keys())
        embed_key = next((k for k in keys if k.endswith("embed_tokens.weight")), None)
        if embed_key is None:
            raise SystemExit(f"{target}/model.safetensors has no embed_tokens.weight")
        embed = f.get_tensor(embed_key).float()
        head = f.get_tensor("lm_head.weight").float() if "lm_head.weight" in keys else embed
        norm_key = embed_key.replace("embed_tokens", "norm")
        final_scale = 1 + f.get_tensor(norm_key).float() if norm_key in keys else torch.ones(embed.shape[1])
    return embed, head, final_scale, {**text, "top": cfg}


def load_cache(data: Path, first_shard: int = 0, end_shard: int | None = None) -> list[dict]:
    """The cached pages (of shards first_shard .. end_shard - 1; all shards are full but the last) with at
    least one anchor to train (index: the page's place in the cache, which is its index in data.py's page
    sources)."""
    pages = [{"ids": torch.from_numpy(p["ids"].astype(np.int64)), "taps": torch.from_numpy(p["taps"]),
              "prompt_len": p["prompt_len"], "index": index}
             for index, p in enumerate(read_cache(data, shards=slice(first_shard, end_shard)),
                                       first_shard * SHARD_PAGES)
             if len(p["ids"]) - p["prompt_len"] >= 2]  # at least one anchor with a label
    return pages


def draw_pages(draws: torch.Tensor, gen: torch.Generator, batch: int, max_reuse: float) -> torch.Tensor | None:
    """The pages of the next batch: the least-drawn first (random order among equals), so that pages
    data.py has just added are drawn before any other page is drawn again; None when that would draw a
    page more than max_reuse times (0: no limit; training then waits for new pages). draws [pages]
    counts each page's sequences so far and is updated."""
    n = len(draws)
    order = (draws + torch.rand(n, generator=gen)).argsort()  # uniform in [0, 1): ties broken at random
    pick = order[torch.arange(batch) % n]  # more sequences than pages: some pages twice
    after = draws.index_add(0, pick, torch.ones(batch))
    if max_reuse and float(after.max()) > max_reuse:
        return None
    draws.copy_(after)
    return pick


def make_batch(pages, pick: list[int], gen: torch.Generator, anchors: int, B: int, mask_id: int):
    """The cached sequences `pick`, each with `anchors` anchor positions in its answer (distinct where it
    has that many, else drawn with replacement): taps [batch, N, width] (float16, zero past a sequence's
    end), the blocks' ids (the anchor, then mask_id), the anchors' positions and the labels [batch,
    anchors, B] (the tokens from the anchor on, -1 past the end). Whole-batch tensor ops, no loop over the
    sequences: batch making runs serial to the GPU's step (0.075 s at batch 512 x 16 anchors, 2 cores)."""
    from torch.nn.utils.rnn import pad_sequence

    batch = len(pick)
    lens = torch.tensor([len(pages[i]["ids"]) for i in pick])
    start = torch.tensor([int(pages[i]["prompt_len"]) for i in pick])
    ids = pad_sequence([pages[i]["ids"] for i in pick], batch_first=True, padding_value=-1)  # [batch, N]
    taps = pad_sequence([pages[i]["taps"] for i in pick], batch_first=True)
    valid = lens - 1 - start  # anchors start .. n - 2 have a next token
    with_replacement = (torch.rand(batch, anchors, generator=gen) * valid[:, None]).long()
    if int(valid.max()) >= anchors:  # the first `anchors` of a random order of 0 .. valid - 1
        keys = torch.rand(batch, int(valid.max()), generator=gen)
        keys[torch.arange(keys.shape[1]) >= valid[:, None]] = 2.0
        distinct = keys.argsort(dim=1)[:, :anchors]
        offsets = torch.where((valid >= anchors)[:, None], distinct, with_replacement)
    else:
        offsets = with_replacement
    anchor_pos = start[:, None] + offsets  # [batch, anchors]
    at = anchor_pos[..., None] + torch.arange(B)  # [batch, anchors, B]
    labels = ids.gather(1, at.clamp(max=ids.shape[1] - 1).flatten(1)).view(batch, anchors, B)
    labels[at >= lens[:, None, None]] = -1
    block_ids = torch.full((batch, anchors, B), mask_id, dtype=torch.long)
    block_ids[..., 0] = labels[..., 0]
    return taps, block_ids, anchor_pos, labels


def losses(model: DFlash2Drafter, head: torch.Tensor, hidden, labels, gamma: float):
    """(weighted CE, selector K-way CE, metrics) for hidden [S, A, B, H], labels [S, A, B]."""
    s = model.spec
    B = labels.shape[-1]
    h, gold = hidden[:, :, 1:], labels[:, :, 1:]
    valid = gold >= 0
    w = torch.exp(-torch.arange(B - 1, dtype=torch.float32, device=hidden.device) / gamma) * valid
    logits = h @ head.T
    ce = F.cross_entropy(logits.flatten(0, 2), gold.clamp(min=0).flatten(), reduction="none").view_as(w)
    ce = (ce * w).sum() / w.sum()
    g = gold.clamp(min=0)
    cand = logits.detach().topk(s.selector_top_k, -1).indices
    present = (cand == g[..., None]).any(-1)
    cand[..., -1] = torch.where(present, cand[..., -1], g)
    target = (cand == g[..., None]).float().argmax(-1)
    prev = labels[:, :, :-1].clamp(min=0)
    scores = logits.gather(-1, cand) + model.candidate_selector.pair_scores(h, prev, cand)
    sel = F.cross_entropy(scores.flatten(0, 2), target.flatten(), reduction="none").view_as(w)
    sel = (sel * w).sum() / w.sum()
    with torch.no_grad():  # accepted prefix of the teacher-forced selector choices
        hit = (cand.gather(-1, scores.argmax(-1, keepdim=True))[..., 0] == g) & valid
        accepted = hit.int().cumprod(-1).sum(-1).float()
        top1 = ((logits.argmax(-1) == g) & valid).sum() / valid.sum()
    return ce, sel, {"top1": top1, "tau_tf": accepted.mean() + 1}  # tensors: read when logged, no sync a step


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", type=Path, required=True)
    ap.add_argument("--data", type=Path, nargs="+", required=True,
                    help="data.py's cache directories (e.g. of data.py processes with other --seed values)")
    ap.add_argument("--out", type=Path, required=True, help="run directory (resumed when it holds ckpt.pt)")
    ap.add_argument("--init", type=Path,
                    help="start from this drafter (z-lab's format, e.g. an earlier run's drafter/; its shape, not the "
                         "options below) with a new optimizer and schedule: training goes on over other pages")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--num-layers", type=int, default=1)
    ap.add_argument("--num-heads", type=int, default=4)
    ap.add_argument("--num-kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--intermediate-size", type=int, default=0, help="0: twice the hidden size")
    ap.add_argument("--selector-rank", type=int, default=64)
    ap.add_argument("--selector-top-k", type=int, default=16)
    ap.add_argument("--mask-token-id", type=int, default=-1, help="-1: the target's video token, else its last id")
    ap.add_argument("--steps", type=int, default=3000,
                    help="schedule length; 0: the cosine follows this run's --minutes instead (one run, no resume)")
    ap.add_argument("--minutes", type=float, default=25.0, help="stop (with a checkpoint) after this much time")
    ap.add_argument("--run-steps", type=int, default=0, help="stop (with a checkpoint) after this many steps of this run")
    ap.add_argument("--batch", type=int, default=4, help="sequences per step")
    ap.add_argument("--max-reuse", type=float, default=0.0,
                    help="wait for data.py's new shards rather than draw any cached page more than this many times "
                         "(0: no limit); see MAX_REUSE_NOTE")
    ap.add_argument("--anchors", type=int, default=16, help="blocks per sequence per step")
    ap.add_argument("--lr", type=float, default=6e-4)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--gamma", type=float, default=0.0, help="0: 7 for B = 16, 4 for B = 8, else B / 2")
    ap.add_argument("--selector-weight", type=float, default=1.0)
    ap.add_argument("--ckpt-every", type=int, default=200)
    ap.add_argument("--log-every", type=int, default=25)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()

    embed, head, final_scale, text = target_tables(args.target)
    metas = [json.loads((d / "meta.json").read_text()) for d in args.data]
    for d, m in zip(args.data[1:], metas[1:]):
        if (m["layers"], m["position_ids"]) != (metas[0]["layers"], metas[0]["position_ids"]):
            raise SystemExit(f"{d} taps layers {m['layers']} ({m['position_ids']}), {args.data[0]} "
                             f"{metas[0]['layers']} ({metas[0]['position_ids']})")
    meta = metas[0]
    shards = [len(shard_files(d)) for d in args.data]  # complete shards read, per cache
    pages = [p for d, n in zip(args.data, shards) for p in load_cache(d, 0, n)]
    if not pages:
        raise SystemExit(f"no usable cached pages in {', '.join(map(str, args.data))} (run data.py first)")
    H, V = int(text["hidden_size"]), int(text["vocab_size"])
    mask_id = args.mask_token_id
    if mask_id < 0:
        mask_id = int(text["top"].get("video_token_id") or V - 1)
    args.out.mkdir(parents=True, exist_ok=True)
    ckpt_path = args.out / "ckpt.pt"
    if ckpt_path.exists():
        if args.steps == 0:
            raise SystemExit("--steps 0 (a schedule over one run's minutes) cannot resume a checkpoint")
        # on the host: load_state_dict moves the model's and the optimizer's tensors to the model's device
        ck = torch.load(ckpt_path, weights_only=False, map_location="cpu")
        spec = DrafterSpec(**ck["spec"])
        if args.init:
            raise SystemExit(f"--init starts a run; {ckpt_path} is one to resume (another --out, or no --init)")
    elif args.init:  # weights only: the optimizer and the schedule start again
        ck = None
        init = DFlash2Drafter.load(args.init)
        spec = init.spec
    else:
        ck = None
        init = None
        spec = DrafterSpec(
            hidden_size=H, vocab_size=V, num_target_layers=int(text["num_hidden_layers"]),
            target_layer_ids=list(meta["layers"]), mask_token_id=mask_id, block_size=args.block_size,
            num_layers=args.num_layers, num_heads=args.num_heads, num_kv_heads=args.num_kv_heads,
            head_dim=args.head_dim, intermediate_size=args.intermediate_size or 2 * H,
            conv_group_size=16 if H % 16 == 0 else 1, selector_rank=args.selector_rank,
            selector_top_k=args.selector_top_k, extra={"position_ids": meta["position_ids"]})
    if spec.target_layer_ids != list(meta["layers"]):
        raise SystemExit(f"the checkpoint taps layers {spec.target_layer_ids}, the cache {meta['layers']}")
    torch.manual_seed(args.seed)
    model = DFlash2Drafter(spec).to(args.device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.01)
    gen = torch.Generator().manual_seed(args.seed)
    step = 0
    if ck is not None:
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        gen.set_state(ck["gen"])
        step = ck["step"]
        print(f"resumed at step {step}", flush=True)
    elif init is not None:
        model.load_state_dict(init.state_dict())
        print(f"weights from {args.init}", flush=True)
    else:  # the drafter's hidden states start at the scale of the target's final ones
        with torch.no_grad():
            model.norm.weight.copy_(final_scale)
    B = spec.block_size
    gamma = args.gamma or GAMMA.get(B, B / 2)
    embed_in = (embed * float(spec.extra.get("input_embedding_scale", 1.0))).to(args.device)
    head = head.to(args.device)
    log = (args.out / "log.jsonl").open("a")
    run_args = vars(args) | {"target": str(args.target), "data": [str(d) for d in args.data], "out": str(args.out),
                             "init": args.init and str(args.init)}
    if ck is None:
        log.write(json.dumps({"start": run_args, "pages": len(pages), "spec": dataclasses.asdict(spec)}) + "\n")
    else:  # a resume may change the schedule (--steps) or the threads
        log.write(json.dumps({"resume": run_args, "step": step, "pages": len(pages)}) + "\n")

    def save() -> None:
        tmp = args.out / "ckpt.pt.tmp"
        torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "gen": gen.get_state(), "step": step,
                    "spec": dataclasses.asdict(spec)}, tmp)
        tmp.replace(ckpt_path)
        model.save(args.out / "drafter")

    def pick_up_new_shards() -> None:
        nonlocal draws
        for i, d in enumerate(args.data):
            now = len(shard_files(d))
            if now != shards[i]:  # data.py has added shards
                pages.extend(load_cache(d, shards[i], now))
                shards[i] = now
        if len(pages) != len(draws):
            draws = torch.cat([draws, torch.zeros(len(pages) - len(draws))])
            print(f"{len(pages)} cached pages at step {step}", flush=True)

    draws = torch.zeros(len(pages))  # sequences drawn per page by this run (a resume counts again)
    waited = 0.0
    acc: dict[str, torch.Tensor] = {}  # the logged means' sums, on the device until they are printed
    n_acc = 0
    by_time = args.steps == 0
    stop_at = math.inf if by_time else min(args.steps, step + args.run_steps) if args.run_steps else args.steps
    while step < stop_at:
        done = (time.perf_counter() - t0) / (60 * args.minutes) if by_time else step / args.steps
        lr = args.lr * min(1.0, (step + 1) / args.warmup) * 0.5 * (1 + math.cos(math.pi * min(done, 1.0)))
        for g in opt.param_groups:
            g["lr"] = lr
        pick = draw_pages(draws, gen, args.batch, args.max_reuse)
        if pick is None:
            if time.perf_counter() - t0 > 60 * args.minutes:
                print(f"time budget spent waiting for data at step {step}", flush=True)
                save()
                break
            time.sleep(1.0)
            waited += 1.0
            pick_up_new_shards()
            continue
        batch = make_batch(pages, pick.tolist(), gen, args.anchors, B, spec.mask_token_id)
        taps, block_ids, anchor_pos, labels = (t.to(args.device, non_blocking=True) for t in batch)
        taps = taps.float()
        hidden = model(taps, block_ids, anchor_pos, embed_in)
        ce, sel, metrics = losses(model, head, hidden, labels, gamma)
        loss = ce + args.selector_weight * sel
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        for k, v in {"ce": ce, "sel": sel, **metrics}.items():
            acc[k] = acc.get(k, 0.0) + v.detach()
        n_acc += 1
        if step % args.log_every == 0 or step == args.steps:
            rec = {"step": step, "lr": lr, **{k: round(float(v) / n_acc, 4) for k, v in acc.items()},
                   "pages": len(pages), "draws_mean": round(float(draws.mean()), 2),
                   "draws_max": int(draws.max()), "waited_s": waited, "elapsed_s": round(time.perf_counter() - t0, 1)}
            log.write(json.dumps(rec) + "\n")
            log.flush()
            print(rec, flush=True)
            acc, n_acc = {}, 0
        out_of_time = time.perf_counter() - t0 > 60 * args.minutes
        if step % args.ckpt_every == 0 or step == stop_at or out_of_time:
            save()
        if step % RELOAD_EVERY == 0:
            pick_up_new_shards()
        if out_of_time:
            print(f"time budget spent at step {step}; rerun to resume", flush=True)
            break
    log.close()


if __name__ == "__main__":
    main()
