"""Do calibrated K/V scales make an fp8 e4m3 KV cache agree with a wide one? (issue 29)

Runs `pitstop verify`'s 12 shipped prompts greedily on the real SmolLM2 with a
float32 cache, recording each layer's largest |K| and |V| as they are stored;
then with an ``fp8_e4m3`` cache, first at unit scales (pitstop's default), then
at per-layer scales ``amax * margin / 448`` (448: e4m3's largest finite value,
so ``margin`` 1 maps each layer's largest value onto it). Prints, for each
setting, how many prompts keep every token of the float32 run and where the
others first differ.

    python benchmarks/fp8_scales.py [--device cpu] [--margins 1,2,8]

The scales are set on each attention layer's ``kv_scale`` buffer, which the
kernel sets divide by when they store and multiply by when they read.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch

from pitstop import LLM, SamplingParams
from pitstop.verify.prompts import shipped_prompts

E4M3_MAX = 448.0


def greedy_tokens(llm: LLM) -> list[list[int]]:
    """The greedy output tokens of each shipped verify prompt."""
    out = []
    for p in shipped_prompts():
        sp = SamplingParams(temperature=0, max_tokens=p.max_tokens)
        done = (
            llm.chat([list(p.messages)], sp, use_tqdm=False)
            if p.messages
            else llm.generate([p.prompt], sp, use_tqdm=False)
        )
        out.append(list(done[0].outputs[0].token_ids))
    return out


def attention_layers(llm: LLM) -> list[torch.nn.Module]:
    """The model's attention layers, in order (the modules holding a ``kv_scale``)."""
    return [m for m in llm.engine.runner.model.modules() if hasattr(m, "kv_scale")]


def record_amax(llm: LLM) -> tuple[list[list[int]], torch.Tensor]:
    """Greedy tokens of the shipped prompts and each layer's largest |K| and |V| ``[layers, 2]``
    as stored (the layers store in order, so the n-th store of a forward is layer n % layers)."""
    kernels = llm.engine.runner.model.kernels
    layers = len(attention_layers(llm))
    amax = torch.zeros(layers, 2)
    calls = [0]
    real = kernels.rope_and_store

    def spy(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *args: Any, **kw: Any) -> Any:
        i = calls[0] % layers
        calls[0] += 1
        amax[i, 0] = max(amax[i, 0].item(), k.abs().max().item())
        amax[i, 1] = max(amax[i, 1].item(), v.abs().max().item())
        return real(q, k, v, *args, **kw)

    kernels.rope_and_store = spy  # the instance attribute shadows the method
    try:
        tokens = greedy_tokens(llm)
    finally:
        del kernels.rope_and_store
    return tokens, amax


def agreement(got: list[list[int]], want: list[list[int]]) -> str:
    """How many prompts keep every token, and each prompt's first differing token (- for none)."""
    first = [
        next((j for j, (a, b) in enumerate(zip(g, w, strict=False)) if a != b), None)
        for g, w in zip(got, want, strict=True)
    ]
    full = sum(f is None and len(g) == len(w) for f, g, w in zip(first, got, want, strict=True))
    return f"{full}/{len(want)} agree in full; first differences " + " ".join(
        "-" if f is None else str(f) for f in first
    )


def main() -> None:
    """Measure the agreement at unit and at calibrated scales; print one line each."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--kernels", default="reference")
    ap.add_argument("--margins", default="1,2,8")
    a = ap.parse_args()
    common = {"model": "smollm2-135m", "device": a.device, "dtype": a.dtype, "kernels": a.kernels}
    wide = LLM(**common)
    want, amax = record_amax(wide)
    del wide
    print("largest |K| per layer:", " ".join(f"{x:.1f}" for x in amax[:, 0].tolist()))
    print("largest |V| per layer:", " ".join(f"{x:.2f}" for x in amax[:, 1].tolist()))
    fp8 = LLM(**common, kv_cache_dtype="fp8_e4m3")
    print("unit scales:", agreement(greedy_tokens(fp8), want))
    for margin in (float(m) for m in a.margins.split(",")):
        for layer, scales in zip(attention_layers(fp8), amax * margin / E4M3_MAX, strict=True):
            layer.kv_scale.copy_(scales.to(layer.kv_scale.device))
        print(f"scales amax x {margin:g} / 448:", agreement(greedy_tokens(fp8), want))


if __name__ == "__main__":
    main()
