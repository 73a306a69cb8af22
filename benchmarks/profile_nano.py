import cProfile, pstats, time, sys
from pitstop import LLM, SamplingParams
import random
llm = LLM("dummy:qwen3-0.6b", kernels="fused", max_model_len=4096)
random.seed(0)
reqs=[[random.randint(0,10000) for _ in range(random.randint(100,1024))] for _ in range(256)]
params=[SamplingParams(max_tokens=random.randint(100,1024), ignore_eos=True, temperature=0.6) for _ in range(256)]
llm.generate(prompt_token_ids=reqs[:8], sampling_params=params[:8], use_tqdm=False)
import torch
pr=cProfile.Profile(); t=time.perf_counter(); pr.enable()
llm.generate(prompt_token_ids=reqs, sampling_params=params, use_tqdm=False)
torch.cuda.synchronize(); pr.disable(); print("wall", time.perf_counter()-t, "steps", llm.engine.stats.steps)
pstats.Stats(pr).sort_stats("tottime").print_stats(18)
