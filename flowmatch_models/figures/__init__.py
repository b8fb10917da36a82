"""Pictures people look at: image grids (grid.py) and loss curves (curves.py), as PNG."""
