"""``nmt plot``: attention maps in the manner of the paper's Figures 3-5 (attention.py), and training
curves (curves.py). matplotlib is an optional extra (figures.py); the options (options.py) import
neither it nor torch, so that `nmt --help` stays fast."""
