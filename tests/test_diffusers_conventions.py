"""What diffusers' `PipelineTesterMixin` checks of a pipeline (and `WanPipeline` passes), on the causal pipelines.

Written from the mixin's intent, reduced to the tiny offline components: `num_videos_per_prompt`, one negative prompt
string for a list of prompts, batch vs single outputs, `encode_prompt` on a pipeline holding only the text encoder,
saving and loading (variants, optional components, the "Loaded <component>" log lines), dict vs tuple outputs, and the
call signature.
"""

from __future__ import annotations

import inspect
import logging

import numpy as np
import PIL.Image
import pytest
import torch
from diffusers.utils import logging as diffusers_logging

from fastgen_diffusers import WanCausalImageToVideoPipeline, WanCausalPipeline, WanCausalVACEPipeline
from fastgen_diffusers.testing import tiny_components, tiny_pipeline, tiny_transformer, tiny_vace_pipeline

CALL = {"height": 16, "width": 16, "num_frames": 9, "num_inference_steps": 2, "max_sequence_length": 16}


def seeds(*values: int) -> list[torch.Generator]:
    return [torch.Generator().manual_seed(value) for value in values]


def i2v_pipeline() -> WanCausalImageToVideoPipeline:
    components = tiny_components()
    components["transformer"] = tiny_transformer(independent_first_frame=True)
    return WanCausalImageToVideoPipeline(**components)


def image() -> PIL.Image.Image:
    return PIL.Image.fromarray(np.random.default_rng(0).integers(0, 256, (16, 16, 3), dtype=np.uint8))


BUILDERS = {"t2v": tiny_pipeline, "i2v": i2v_pipeline, "vace": tiny_vace_pipeline}
EXTRA = {"t2v": {}, "i2v": {"image": image()}, "vace": {}}


@pytest.fixture(scope="module", params=sorted(BUILDERS))
def kind_and_pipe(request):
    pipe = BUILDERS[request.param]()
    pipe.set_progress_bar_config(disable=True)
    return request.param, pipe


def test_num_videos_per_prompt_repeats_each_prompt(kind_and_pipe):
    kind, pipe = kind_and_pipe
    kwargs = CALL | EXTRA[kind] | {"output_type": "latent"}
    for prompts in ("a red fox", ["a red fox", "a cat"]):
        batch = 1 if isinstance(prompts, str) else len(prompts)
        for per_prompt in (1, 2):
            generators = seeds(*range(batch * per_prompt))
            frames = pipe(prompt=prompts, num_videos_per_prompt=per_prompt, generator=generators, **kwargs).frames
            assert frames.shape[0] == batch * per_prompt
    # the same as passing each prompt twice
    repeated = pipe(prompt=["a red fox", "a cat"], num_videos_per_prompt=2, generator=seeds(0, 1, 2, 3), **kwargs)
    listed = pipe(prompt=["a red fox"] * 2 + ["a cat"] * 2, generator=seeds(0, 1, 2, 3), **kwargs)
    torch.testing.assert_close(repeated.frames, listed.frames)


def test_num_videos_per_prompt_repeats_embeddings_and_streams():
    pipe = tiny_pipeline()
    pipe.set_progress_bar_config(disable=True)
    embeds = torch.randn(1, 8, 32, generator=torch.Generator().manual_seed(0))
    kwargs = CALL | {"output_type": "latent", "prompt_embeds": embeds, "num_videos_per_prompt": 3}
    frames = pipe(generator=seeds(0, 1, 2), **kwargs).frames
    streamed = torch.cat([chunk.latents for chunk in pipe.stream(generator=seeds(0, 1, 2), **kwargs)], dim=2)
    assert frames.shape[0] == 3
    torch.testing.assert_close(streamed, frames, rtol=0, atol=0)


def test_one_negative_prompt_string_serves_a_list_of_prompts(kind_and_pipe):
    kind, pipe = kind_and_pipe
    kwargs = CALL | EXTRA[kind] | {"output_type": "latent", "prompt": ["a red fox", "a cat"], "guidance_scale": 3.0}
    single = pipe(negative_prompt="blurry", generator=seeds(0, 1), **kwargs).frames
    listed = pipe(negative_prompt=["blurry", "blurry"], generator=seeds(0, 1), **kwargs).frames
    torch.testing.assert_close(single, listed, rtol=0, atol=0)


def test_a_batch_gives_what_each_prompt_gives_alone(kind_and_pipe):
    kind, pipe = kind_and_pipe
    kwargs = CALL | EXTRA[kind] | {"output_type": "latent"}
    batch = pipe(prompt=["a red fox", "a cat"], generator=seeds(0, 1), **kwargs).frames
    alone = pipe(prompt="a cat", generator=seeds(1)[0], **kwargs).frames
    torch.testing.assert_close(batch[1:], alone, rtol=1e-4, atol=1e-4)


def test_dict_and_tuple_outputs_are_equal(kind_and_pipe):
    kind, pipe = kind_and_pipe
    kwargs = CALL | EXTRA[kind] | {"prompt": "a red fox", "output_type": "np"}
    as_dict = pipe(generator=seeds(0)[0], **kwargs).frames
    (as_tuple,) = pipe(generator=seeds(0)[0], return_dict=False, **kwargs)
    np.testing.assert_array_equal(as_dict, as_tuple)


def test_call_signature_has_diffusers_video_arguments(kind_and_pipe):
    _, pipe = kind_and_pipe
    parameters = inspect.signature(pipe.__call__).parameters
    expected = {
        "prompt", "negative_prompt", "height", "width", "num_frames", "num_inference_steps", "guidance_scale",
        "num_videos_per_prompt", "generator", "latents", "prompt_embeds", "negative_prompt_embeds", "output_type",
        "return_dict", "attention_kwargs", "callback_on_step_end", "callback_on_step_end_tensor_inputs",
        "max_sequence_length",
    }  # fmt: skip
    assert expected <= set(parameters)
    assert set(pipe.components) == set(inspect.signature(type(pipe).__init__).parameters) & set(pipe.components)


@pytest.mark.parametrize("pipeline_class", [WanCausalPipeline, WanCausalImageToVideoPipeline, WanCausalVACEPipeline])
def test_encode_prompt_works_on_a_pipeline_with_only_the_text_encoder(pipeline_class):
    components = tiny_components()
    text_only = {
        name: (value if name in ("tokenizer", "text_encoder") else None) for name, value in components.items()
    }
    pipe = pipeline_class(**text_only)
    prompt_embeds, negative_prompt_embeds = pipe.encode_prompt(
        "a red fox", negative_prompt="blurry", do_classifier_free_guidance=True, max_sequence_length=16
    )
    assert prompt_embeds.shape == negative_prompt_embeds.shape == (1, 16, 32)
    with pytest.raises(ValueError, match="has no transformer"):
        pipe("a red fox", **CALL)

    if pipeline_class is WanCausalPipeline:  # the embeddings drive a pipeline without text encoder identically
        full = WanCausalPipeline(**components)
        without_text = WanCausalPipeline(**{**components, "tokenizer": None, "text_encoder": None})
        for p in (full, without_text):
            p.set_progress_bar_config(disable=True)
        kwargs = CALL | {"output_type": "latent", "guidance_scale": 3.0}
        expected = full(prompt="a red fox", negative_prompt="blurry", generator=seeds(0)[0], **kwargs).frames
        embedded = without_text(
            prompt_embeds=prompt_embeds,
            negative_prompt_embeds=negative_prompt_embeds,
            generator=seeds(0)[0],
            **kwargs,
        ).frames
        torch.testing.assert_close(embedded, expected, rtol=1e-4, atol=1e-4)


class Captured(logging.Handler):
    def __init__(self):
        super().__init__(level=logging.INFO)
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


@pytest.mark.parametrize("builder", [tiny_pipeline, tiny_vace_pipeline], ids=["t2v", "vace"])
def test_saving_and_loading_follow_diffusers(builder, tmp_path):
    pipe = builder()
    cls = type(pipe)
    pipe.save_pretrained(tmp_path / "plain")
    with pytest.raises(ValueError, match="You are trying to load the model files of the `variant=fp16`"):
        cls.from_pretrained(tmp_path / "plain", variant="fp16")

    pipe.save_pretrained(tmp_path / "fp16", variant="fp16")
    root = diffusers_logging.get_logger("diffusers")
    handler, verbosity = Captured(), diffusers_logging.get_verbosity()
    root.addHandler(handler)
    diffusers_logging.set_verbosity_info()
    try:
        loaded = cls.from_pretrained(tmp_path / "fp16", variant="fp16")
    finally:
        root.removeHandler(handler)
        diffusers_logging.set_verbosity(verbosity)
    for name in ("transformer", "vae", "scheduler", "text_encoder", "tokenizer"):
        line = f"Loaded {name} as {type(getattr(loaded, name)).__name__} from `{name}` subfolder of"
        assert any(message.startswith(line) for message in handler.lines), (name, handler.lines)
    for (name, a), b in zip(pipe.transformer.state_dict().items(), loaded.transformer.state_dict().values()):
        assert torch.equal(a, b), name

    encoder_only = cls.from_pretrained(tmp_path / "plain", transformer=None, vae=None)
    assert encoder_only.transformer is None
    assert encoder_only.encode_prompt("a red fox", max_sequence_length=16)[0].shape == (1, 16, 32)


def test_optional_components_save_and_load_as_none(tmp_path):
    pipe = tiny_pipeline()
    pipe.set_progress_bar_config(disable=True)
    embeds = torch.randn(1, 8, 32, generator=torch.Generator().manual_seed(0))
    kwargs = CALL | {"output_type": "latent", "prompt_embeds": embeds}
    expected = pipe(generator=seeds(0)[0], **kwargs).frames
    pipe.tokenizer = pipe.text_encoder = None
    pipe.register_modules(tokenizer=None, text_encoder=None)
    pipe.save_pretrained(tmp_path)
    loaded = WanCausalPipeline.from_pretrained(tmp_path)
    loaded.set_progress_bar_config(disable=True)
    assert loaded.tokenizer is None and loaded.text_encoder is None
    torch.testing.assert_close(loaded(generator=seeds(0)[0], **kwargs).frames, expected, rtol=1e-4, atol=1e-4)
