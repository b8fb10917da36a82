"""Using a trained model: sample a grid (sample.py), export a diffusers SanaPipeline (export.py, export_format.py)."""
