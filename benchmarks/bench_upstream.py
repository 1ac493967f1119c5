"""Our rollout against upstream Self-Forcing's own inference on the same random weights (CPU).

Upstream is guandeh17/Self-Forcing (checked at 33593df), a tree you fetch yourself (never part of this repository),
run in this process: its ``CausalWanModel`` inside its ``CausalInferencePipeline.inference`` (text encoder and VAE
stubbed: the same 512 x 4096 text embeddings, latents out; FlashAttention, CUDA-only, replaced by float32 SDPA in its
``(B, L, N, D)`` layout), against ``WanCausalPipeline(prompt_embeds=..., output_type="latent")`` with the same weights
converted by ``original_to_diffusers_state_dict``.

Wan2.1-1.3B width (dim 1536, 12 x 128 heads, ffn 8960), ``--layers`` blocks (default 1), 512 x 4096 text, 21 latent
frames x 390 tokens (240x416 pixels), chunks of 3, 4 steps (1000, 937.5, 833.3, 625) and a cache pass per chunk (the
pipeline skips the last one), float32, one thread. After a warm-up of each, the two run interleaved ``--repeats``
times; the ratio is of the medians of process CPU time (robust on a shared machine) and of wall time.

    python benchmarks/bench_upstream.py --upstream /path/to/Self-Forcing [--repeats 3] [--layers 1]
    python benchmarks/bench_upstream.py --upstream ... --check      # 1 step, no re-noising draws: latents agree
    python benchmarks/bench_upstream.py --upstream ... --profile ours  # cProfile of one rollout (after a warm-up)

Upstream imports ``einops`` (and ``easydict``, stubbed here): put it on ``--extra-path`` if it is not installed. With
4 steps the final latents differ (upstream draws its re-noising with ``torch.randn_like`` in its own layout):
``--check`` shows that they agree without re-noising. The timed runs print each side's transformer calls per rollout:
upstream runs the last chunk's cache pass too (its output is never read), which ours skips, so the ratio includes
that saving.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import statistics
import sys
import time
import types

import torch


def import_upstream(root: str, extra_path: str | None):
    sys.path.insert(0, root)
    if extra_path:
        sys.path.append(extra_path)
    easydict = types.ModuleType("easydict")

    class EasyDict(dict):
        def __getattr__(self, key):
            try:
                return self[key]
            except KeyError:
                raise AttributeError(key) from None

        def __setattr__(self, key, value):
            self[key] = value

    easydict.EasyDict = EasyDict
    sys.modules.setdefault("easydict", easydict)
    for package in ("wan", "pipeline"):  # skip their __init__ (they import the whole upstream app)
        stub = types.ModuleType(package)
        stub.__path__ = [f"{root}/{package}"]
        sys.modules[package] = stub
    current_device = torch.cuda.current_device
    torch.cuda.current_device = lambda: 0  # upstream asks for a CUDA device at import time
    try:
        from pipeline.causal_inference import CausalInferencePipeline
        from utils.scheduler import FlowMatchScheduler
        from utils.wan_wrapper import WanDiffusionWrapper
        from wan.modules.causal_model import CausalWanModel
    finally:
        torch.cuda.current_device = current_device
    import wan.modules.causal_model as causal_model
    import wan.modules.model as wan_model

    def sdpa(q, k, v, *args, **kwargs):  # FlashAttention is CUDA-only: float32 SDPA in its (B, L, N, D) layout
        out = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        return out.transpose(1, 2).contiguous()

    causal_model.attention = sdpa
    wan_model.flash_attention = sdpa
    return CausalInferencePipeline, FlowMatchScheduler, WanDiffusionWrapper, CausalWanModel


class TextStub(torch.nn.Module):
    def __init__(self, embeds):
        super().__init__()
        self.embeds = embeds

    def forward(self, text_prompts):
        return {"prompt_embeds": self.embeds}


class VAEStub(torch.nn.Module):
    def decode_to_pixel(self, latent, use_cache=False):
        return latent


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--upstream", required=True, help="a checkout of guandeh17/Self-Forcing")
    parser.add_argument("--extra-path", default=None, help="a folder with upstream's dependencies (einops)")
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--profile", choices=["ours", "upstream"], default=None)
    parser.add_argument("--profile-out", default=None)
    parser.add_argument("--check", action="store_true", help="1 step (no re-noising draws): latents must agree")
    parser.add_argument("--count", action="store_true", help="count linear calls per module and input shape")
    parser.add_argument("--only", choices=["ours", "upstream"], default=None)
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")
    torch.set_num_threads(args.threads)

    CausalInferencePipeline, FlowMatchScheduler, WanDiffusionWrapper, CausalWanModel = import_upstream(
        args.upstream, args.extra_path
    )
    from fastgen_diffusers import WanCausalPipeline, WanCausalTransformer3DModel
    from fastgen_diffusers.convert.mapping import original_to_diffusers_state_dict
    from fastgen_diffusers.testing import tiny_components

    torch.manual_seed(0)
    model = (
        CausalWanModel(
            model_type="t2v",
            patch_size=(1, 2, 2),
            text_len=512,
            in_dim=16,
            dim=1536,
            ffn_dim=8960,
            freq_dim=256,
            text_dim=4096,
            out_dim=16,
            num_heads=12,
            num_layers=args.layers,
            qk_norm=True,
            cross_attn_norm=True,
            eps=1e-6,
        )
        .eval()
        .requires_grad_(False)
    )
    with torch.no_grad():
        for p in model.parameters():  # default init leaves zeros (head, modulation): random everywhere
            p.copy_(torch.randn_like(p) * (p.shape[-1] ** -0.5 if p.dim() > 1 else 0.1))
    wrapper = WanDiffusionWrapper.__new__(WanDiffusionWrapper)
    torch.nn.Module.__init__(wrapper)
    wrapper.model = model
    wrapper.uniform_timestep = False
    wrapper.scheduler = FlowMatchScheduler(shift=5.0, sigma_min=0.0, extra_one_step=True)
    wrapper.scheduler.set_timesteps(1000, training=True)
    wrapper.seq_len = 32760
    wrapper.post_init()

    text = torch.randn(1, 512, 4096)
    upstream_args = types.SimpleNamespace(
        denoising_step_list=[1000] if args.check else [1000, 750, 500, 250],
        warp_denoising_step=True,
        num_frame_per_block=3,
        independent_first_frame=False,
        context_noise=0,
        model_kwargs={"timestep_shift": 5.0},
    )
    with contextlib.redirect_stdout(io.StringIO()):
        upstream = CausalInferencePipeline(
            upstream_args, "cpu", generator=wrapper, text_encoder=TextStub(text), vae=VAEStub()
        )
    upstream.num_transformer_blocks = args.layers
    upstream.frame_seq_length = 390

    components = tiny_components()
    transformer = WanCausalTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=12,
        attention_head_dim=128,
        in_channels=16,
        out_channels=16,
        text_dim=4096,
        freq_dim=256,
        ffn_dim=8960,
        num_layers=args.layers,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        eps=1e-6,
    ).eval()
    missing, unexpected = transformer.load_state_dict(
        original_to_diffusers_state_dict(model.state_dict()), strict=False
    )
    assert not unexpected, unexpected
    assert all("rope" in k for k in missing), missing
    components["transformer"] = transformer
    ours = WanCausalPipeline(**components)
    ours.set_progress_bar_config(disable=True)

    noise = torch.randn(1, 21, 16, 30, 52)  # upstream layout (B, F, C, H, W)

    def run_upstream():
        torch.manual_seed(1)
        with contextlib.redirect_stdout(io.StringIO()), torch.no_grad():
            _, latents = upstream.inference(noise, ["p"], return_latents=True)
        return latents.permute(0, 2, 1, 3, 4)

    def run_ours():
        return ours(
            prompt_embeds=text,
            latents=noise.permute(0, 2, 1, 3, 4).contiguous(),
            height=240,
            width=416,
            num_frames=81,
            output_type="latent",
            num_inference_steps=1 if args.check else None,
            generator=torch.Generator().manual_seed(1),
        ).frames

    if args.count:
        import collections

        for label, root, run in (("ours", transformer, run_ours), ("upstream", model, run_upstream)):
            counts = collections.Counter()
            hooks = [
                m.register_forward_hook(lambda m, i, o, n=n, c=counts: c.update([(n, tuple(i[0].shape[:-1]))]))
                for n, m in root.named_modules()
                if isinstance(m, torch.nn.Linear)
            ]
            run()
            for h in hooks:
                h.remove()
            print(label, sum(counts.values()))
            for key, c in sorted(counts.items()):
                print("  ", key, c)
        return
    if args.check:
        a, b = run_ours(), run_upstream()
        print("1-step latents max abs diff", (a - b).abs().max().item(), "max abs", b.abs().max().item())
        return
    runs = {"ours": run_ours, "upstream": run_upstream}
    if args.profile:
        runs[args.profile]()  # warm-up
        import cProfile
        import pstats

        profiler = cProfile.Profile()
        profiler.enable()
        runs[args.profile]()
        profiler.disable()
        if args.profile_out:
            profiler.dump_stats(args.profile_out)
        pstats.Stats(profiler).sort_stats("tottime").print_stats(25)
        pstats.Stats(profiler).sort_stats("cumulative").print_stats(40)
        return

    names = [args.only] if args.only else ["ours", "upstream"]
    roots = {"ours": transformer, "upstream": model}
    for name in names:  # warm-up, counting the transformer calls of one rollout
        calls = []
        hook = roots[name].register_forward_hook(lambda *_, c=calls: c.append(1))
        runs[name]()
        hook.remove()
        print(f"{name}: {len(calls)} transformer calls per rollout", flush=True)
    cpu = {name: [] for name in names}
    wall = {name: [] for name in names}
    for r in range(args.repeats):
        order = names if r % 2 == 0 else names[::-1]
        for name in order:
            c0, w0 = time.process_time(), time.perf_counter()
            runs[name]()
            cpu[name].append(time.process_time() - c0)
            wall[name].append(time.perf_counter() - w0)
            print(f"run {r} {name}: cpu {cpu[name][-1]:.2f} s wall {wall[name][-1]:.2f} s", flush=True)
    for name in names:
        print(
            f"{name}: cpu median {statistics.median(cpu[name]):.2f} s, "
            f"wall median {statistics.median(wall[name]):.2f} s"
        )
    if len(names) == 2:  # upstream also runs the last chunk's cache pass, whose output nothing reads (ours skips it)
        print(
            f"ratio ours/upstream: cpu {statistics.median(cpu['ours']) / statistics.median(cpu['upstream']):.3f} "
            f"wall {statistics.median(wall['ours']) / statistics.median(wall['upstream']):.3f}"
        )


if __name__ == "__main__":
    main()
