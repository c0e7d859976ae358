"""Random kernel inputs shared by the kernel tests: no zeros, both signs, on the GPU where there is one."""

import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def rand(g, *shape, dtype=torch.float32):
    """Uniform in +-[0.1, 1.1): no zeros, both signs."""
    sign = torch.randint(0, 2, shape, generator=g) * 2 - 1
    return ((torch.rand(*shape, generator=g) + 0.1) * sign).to(dtype).to(DEVICE)


def engine_through_kernel(monkeypatch, module) -> tuple[list, list, int]:
    """A tiny model's engine (3 prompts, 4 heads, 3 lookup nodes) run on the references, then again with
    `module.use_triton` forced on, so the interpreter runs that module's kernels on the CPU tensors.
    -> (outputs with the references, outputs with the kernels, kernel dispatches); outputs are (token ids,
    accepted lengths) per prompt."""
    from medusa.decoding.engine import EngineConfig, LLMEngine
    from medusa.decoding.sampling_params import SamplingParams
    from tiny_models import tiny_decoder

    model, heads = tiny_decoder(24, logit_scale=3, num_heads=4)
    prompts = [[1, 2, 3, 4, 1, 2, 3], [5, 6, 7], [8, 9, 8, 9, 8, 9, 8, 9]]
    params = SamplingParams(max_tokens=12, ignore_eos=True)

    def run():
        engine = LLMEngine(model, heads, EngineConfig(prompt_lookup=3, num_blocks=64, block_size=4))
        outs = engine.generate(prompts, params)
        return [o.token_ids for o in outs], [o.stats.accepted_lengths for o in outs]

    want = run()
    calls = []
    monkeypatch.setattr(module, "use_triton", lambda x, *rest: calls.append(1) or True)
    return want, run(), len(calls)
