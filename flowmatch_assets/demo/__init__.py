"""The embedded demo: the synthetic PD12M-format dataset (``dataset``), its images through the
image stage (``images``) and the committed demo VAE (``vae/``)."""

from pathlib import Path

#: The committed demo VAE (an AutoencoderDC trained on the synthetic sample only, not the real
#: DC-AE; `scripts/train_demo_vae.py`): the VAE of the demo's data root. Its marker file
#: (``flowmatch_models.encoders.zoo.DEMO_WEIGHTS_MARKER``) says what it is and how it was trained.
DEMO_VAE = Path(__file__).resolve().parent / "vae"
