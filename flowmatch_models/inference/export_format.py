"""The files flowmatch adds beside an exported ``transformer/`` (``export.py`` writes them,
``sample.py`` reads them): their own module so that neither imports the other for them."""

#: The encoded empty prompt (text_embeddings' null_tokens): the null caption of CFG.
NULL_FILE = "null_caption.safetensors"
#: What the sampler needs beside diffusers' config: scaling factor, preset, flow shift, text width,
#: prompt token limit (max_tokens), buckets, null caption (inference/export.py writes it).
META_FILE = "flowmatch.json"


def prompt_max_tokens(meta: dict) -> int:
    """How many tokens a prompt is cut to for a model of this metadata (a checkpoint's
    ``flowmatch`` info or an export's ``flowmatch.json``): as the captions of the text
    embeddings it trained on were (``encoders.max_tokens``); a model made before it was
    recorded: the default."""
    from flowmatch_models.encoders.spec import DEFAULT_MAX_TOKENS

    return int(meta.get("max_tokens") or DEFAULT_MAX_TOKENS)
