#!/usr/bin/env python3
"""Export a training checkpoint as an ordinary Hugging Face checkpoint, and check it in ocria_rt.

    python scripts/train_ocr/export.py --ckpt runs/a/ckpt --out python/ocria_rt/models/ocria-tiny [--check]

Writes config.json + model.safetensors (BF16, tied embeddings: no lm_head), tokenizer.json,
tokenizer_config.json (with the chat template), preprocessor_config.json and generation_config.json
(greedy, stops at <|im_end|> / <|endoftext|>); refuses to write more than --max-mb (25) MB.

--check runs :func:`check_export`: the directory loads in ocria_rt (``ocria_rt.Engine`` and
``Engine.chat``) and, on a held-out page of the model's training distribution, ocria_rt's CPU logits
match transformers' (fp32, the same BF16 weights upcast) and the greedy tokens are the same.
--reference DIR saves that page and transformers' side of the check (prompt ids, the logits of the
last teacher-forced tokens, the greedy tokens) for the tests; --sample DIR writes the package's sample
document (see :func:`write_sample`).

The shipped default model is made with

    python scripts/train_ocr/export.py --ckpt CKPT --out python/ocria_rt/models/ocria-mini --check \
        --reference tests/fixtures/ocria_mini --sample python/ocria_rt/samples
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

import ckpt  # noqa: E402
from common import DEFAULT_PROMPT, synthdoc  # noqa: E402


def export(ckpt_dir: Path, out: Path, max_mb: float = 25.0) -> dict:
    from transformers import GenerationConfig, Qwen3_5Config, Qwen3_5ForConditionalGeneration

    state, tensors = ckpt.load(ckpt_dir)
    config = Qwen3_5Config.from_dict(state["model_config"])
    config.text_config.use_cache = True
    model = Qwen3_5ForConditionalGeneration(config)
    missing, unexpected = model.load_state_dict(ckpt.model_weights(tensors), strict=False)
    assert not unexpected and all(k == "lm_head.weight" for k in missing), (missing, unexpected)
    model.tie_weights()
    model = model.to(torch.bfloat16).eval()
    out.mkdir(parents=True, exist_ok=True)
    for f in out.glob("model*.safetensors*"):
        f.unlink()
    model.save_pretrained(out, safe_serialization=True, max_shard_size="200MB")
    for name, text in state["tokenizer_files"].items():
        (out / name).write_text(text)
    common.write_json(out / "preprocessor_config.json", state["preprocessor_config"])
    tok_cfg = json.loads(state["tokenizer_files"]["tokenizer_config.json"])
    ids = {v["content"]: int(k) for k, v in tok_cfg["added_tokens_decoder"].items()}
    GenerationConfig(bos_token_id=None, eos_token_id=[ids["<|im_end|>"], ids["<|endoftext|>"]],
                     pad_token_id=ids["<|endoftext|>"], do_sample=False).save_pretrained(out)
    files = sorted(p for p in out.iterdir() if p.is_file())
    for p in files:
        p.chmod(0o644)  # save_pretrained leaves the weights owner-only
    total = sum(p.stat().st_size for p in files)
    if total > max_mb * 1e6:
        raise SystemExit(f"{out}: {total / 1e6:.1f} MB is over the {max_mb} MB limit")
    n_params = sum(p.numel() for p in model.parameters())
    info = {"dir": str(out), "bytes": total, "params": n_params, "step": state["run"]["step"],
            "files": {p.name: p.stat().st_size for p in files}}
    if "page_sources" not in state:
        print(f"warning: {ckpt_dir} does not say what its pages' text and fonts came from (a checkpoint from "
              f"before train.py recorded it): training.json gets no text_source / fonts and ocria-rt eval "
              f"cannot check them", file=sys.stderr)
    (out / "training.json").write_text(json.dumps({
        "preset": state.get("preset"), "step": state["run"]["step"], "pages": state["run"]["pages"],
        "tokens": state["run"]["tokens"], "train_seconds": round(state["run"]["train_seconds"], 1),
        "runs": state["run"]["runs"], "params": n_params, "data": state["data"], "schedule": state["schedule"],
        **state.get("page_sources", {}),
    }, indent=1) + "\n")
    return info


REFERENCE_ROWS = 32  # logits rows kept in the tests' reference (the end of the teacher-forced answer)


def rel_err(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a.astype(np.float64) - b) / max(1e-30, np.linalg.norm(b.astype(np.float64))))


def check_export(model_dir: Path, page_seed: int | None = None, n_tokens: int = 24, threads: int = 0,
                 reference: Path | None = None) -> dict:
    """Loads `model_dir` in ocria_rt and in transformers; on a held-out page (of the model's training
    distribution, training.json) compares the prompt ids (ocria_rt.chat vs transformers' processor), the
    logits of the whole prompt (relative error ||a - b|| / ||b||) and greedy generation (ocria_rt
    Engine.chat vs transformers generate). `reference`: a directory that receives the page (page.png)
    and transformers' results (reference.npz: input_ids = prompt + teacher-forced answer, the logits
    of the last REFERENCE_ROWS positions, the greedy tokens)."""
    if not common.HAS_ENGINE:
        raise SystemExit("ocria_rt's compiled engine is not importable here (build it: pip install .)")
    import ocria_rt
    from ocria_rt.chat import build_multimodal_prompt
    from transformers import GenerationConfig, Qwen3_5ForConditionalGeneration

    model_dir = Path(model_dir)
    seed = synthdoc.page_seed("heldout", 0) if page_seed is None else page_seed
    image, ref, meta = synthdoc.generate_page(seed, synthdoc.heldout_page_config(model_dir)[0])
    msgs = [{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": DEFAULT_PROMPT}]}]
    eng = ocria_rt.Engine(model_dir, device="cpu", num_threads=threads)
    ids, pv, grid = build_multimodal_prompt(eng, msgs)
    answer = eng.encode(ref)[:64]  # teacher-forced: the page's true Markdown after the prompt
    ours = eng.score(list(ids) + answer, pixel_values=pv, image_grid_thw=grid)

    hf = Qwen3_5ForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
    hf = hf.float().eval()
    img_id = hf.config.image_token_id
    eos = [int(t) for t in eng.eos_token_ids]
    t_ids = torch.tensor([list(ids) + answer])
    with torch.no_grad():
        hf.model.rope_deltas = None
        theirs = hf(input_ids=t_ids, pixel_values=torch.from_numpy(pv), image_grid_thw=torch.from_numpy(grid),
                    mm_token_type_ids=(t_ids == img_id).int(), use_cache=False).logits[0].numpy()
    proc_ids = _processor_ids(model_dir, image)

    res = eng.chat(msgs, max_new_tokens=n_tokens)  # greedy, stops at the model's end tokens
    p_ids = torch.tensor([list(ids)])
    gc = GenerationConfig(do_sample=False, max_new_tokens=n_tokens, eos_token_id=eos, pad_token_id=eos[-1],
                          bos_token_id=None, use_cache=True, num_beams=1)
    with torch.no_grad():
        hf.model.rope_deltas = None
        g = hf.generate(input_ids=p_ids, attention_mask=torch.ones_like(p_ids), pixel_values=torch.from_numpy(pv),
                        image_grid_thw=torch.from_numpy(grid), mm_token_type_ids=(p_ids == img_id).int(),
                        generation_config=gc)
    hf_new = g[0, len(ids):].tolist()
    # and n tokens without stopping (exercises the decode path past an early end token)
    res_n = eng.chat(msgs, max_new_tokens=n_tokens, stop_token_ids=[])
    gc_n = GenerationConfig(do_sample=False, max_new_tokens=n_tokens, eos_token_id=None, pad_token_id=eos[-1],
                            bos_token_id=None, use_cache=True, num_beams=1)
    hf.generation_config.eos_token_id = None  # else generate() falls back to the model's end tokens
    with torch.no_grad():
        hf.model.rope_deltas = None
        g_n = hf.generate(input_ids=p_ids, attention_mask=torch.ones_like(p_ids), pixel_values=torch.from_numpy(pv),
                          image_grid_thw=torch.from_numpy(grid), mm_token_type_ids=(p_ids == img_id).int(),
                          generation_config=gc_n)
    hf_n = g_n[0, len(ids):].tolist()
    top2 = np.sort(theirs, axis=-1)[:, -2:]
    out = {
        "page_seed": seed, "prompt_tokens": len(ids), "image_tokens": int(np.prod(grid)) // 4,
        "teacher_forced_tokens": len(answer),
        "ids_equal_processor": None if proc_ids is None else proc_ids == list(ids),
        "logits_rel_err": rel_err(ours, theirs),
        "answer_logits_rel_err": rel_err(ours[len(ids):], theirs[len(ids):]),
        "argmax_agree": float((ours.argmax(-1) == theirs.argmax(-1)).mean()),
        "min_top2_margin": float((top2[:, 1] - top2[:, 0]).min()),
        "greedy_tokens": len(hf_new),
        "greedy_equal": list(res.token_ids) == hf_new,
        "greedy_ocria": eng.decode(list(res.token_ids)),
        "greedy_transformers": eng.decode(hf_new),
        "greedy_no_stop_tokens": len(hf_n),
        "greedy_no_stop_equal": list(res_n.token_ids) == hf_n,
        "reference_start": ref[:120],
    }
    if reference is not None:
        reference.mkdir(parents=True, exist_ok=True)
        image.save(reference / "page.png")
        np.savez_compressed(reference / "reference.npz", page_seed=np.int64(seed), input_ids=t_ids[0].numpy().astype(np.int32),
                            prompt_tokens=np.int32(len(ids)), logits=theirs[-REFERENCE_ROWS:].astype(np.float32),
                            greedy_tokens=np.array(hf_new, dtype=np.int32),
                            greedy_no_stop_tokens=np.array(hf_n, dtype=np.int32))
    return out


def write_sample(model_dir: Path, out: Path, n_pages: int = 4) -> dict:
    """The package's sample document: the first `n_pages` held-out pages (seed 0) of the model's training
    distribution as one PDF at 72 dpi (a page's size in points is its image's size in pixels), and their
    Markdown (sample.json), so that ``ocria-rt parse --sample`` can score what it printed."""
    cfg = synthdoc.heldout_page_config(model_dir)[0]
    pages = list(synthdoc.iter_dataset("heldout", n_pages, 0, cfg))
    out.mkdir(parents=True, exist_ok=True)
    images = [im.convert("RGB") for im, _, _ in pages]
    epoch = time.gmtime(0)  # fixed dates: the same pages give the same bytes, export after export
    images[0].save(out / "sample.pdf", resolution=72.0, save_all=True, append_images=images[1:],
                   creationDate=epoch, modDate=epoch)
    meta = {"model": Path(model_dir).name, "split": "heldout", "seed": 0,
            "page_seeds": [m["seed"] for _, _, m in pages], "markdown": [md for _, md, _ in pages]}
    common.write_json(out / "sample.json", meta)
    return {"dir": str(out), "pages": n_pages, "bytes": (out / "sample.pdf").stat().st_size}


def _processor_ids(model_dir: Path, image) -> list[int] | None:
    """Prompt ids from transformers' Qwen3VLProcessor (AutoProcessor; without torchvision, the same
    class from its image processor and tokenizer), or None when it cannot be built here."""
    try:
        from transformers import AutoProcessor

        proc = AutoProcessor.from_pretrained(model_dir)
    except Exception:  # noqa: BLE001 - the video processor needs torchvision
        try:
            from transformers import AutoTokenizer
            from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
            from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor

            cfg = json.loads((model_dir / "preprocessor_config.json").read_text())
            template = json.loads((model_dir / "tokenizer_config.json").read_text())["chat_template"]
            Qwen3VLProcessor.get_attributes = classmethod(lambda cls: ["image_processor", "tokenizer"])
            proc = Qwen3VLProcessor(image_processor=Qwen2VLImageProcessorPil(**cfg),
                                    tokenizer=AutoTokenizer.from_pretrained(model_dir), chat_template=template)
        except Exception:  # noqa: BLE001
            return None
    msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": DEFAULT_PROMPT}]}]
    text = proc.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    return [int(x) for x in proc(text=[text], images=[image], return_tensors="np")["input_ids"][0]]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    ap.add_argument("--ckpt", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--max-mb", type=float, default=25.0)
    ap.add_argument("--check", action="store_true", help="check the export in ocria_rt against transformers")
    ap.add_argument("--reference", type=Path, default=None, help="with --check: save the page and transformers' results here")
    ap.add_argument("--sample", type=Path, default=None, help="write the sample document (sample.pdf, sample.json) here")
    ap.add_argument("--sample-pages", type=int, default=4)
    args = ap.parse_args()
    if args.reference and not args.check:
        ap.error("--reference needs --check")
    info = export(args.ckpt, args.out, args.max_mb)
    print(json.dumps(info, indent=1))
    if args.check:
        print(json.dumps(check_export(args.out, reference=args.reference), indent=1))
    if args.sample:
        print(json.dumps(write_sample(args.out, args.sample, args.sample_pages), indent=1))


if __name__ == "__main__":
    main()
