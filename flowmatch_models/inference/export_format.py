"""The files flowmatch adds beside an exported ``transformer/`` (``export.py`` writes them,
``sample.py`` reads them): their own module so that neither imports the other for them."""

#: The encoded empty prompt (text_embeddings' null_tokens): the null caption of CFG.
NULL_FILE = "null_caption.safetensors"
#: What the sampler needs beside diffusers' config: scaling factor, preset, flow shift, null caption.
META_FILE = "flowmatch.json"
