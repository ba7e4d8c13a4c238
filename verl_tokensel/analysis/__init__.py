"""Token analysis: per-token entropy, log-prob, exact logit-gradient norm and GMTS score of
responses under a local HF model, and the reports built on them (``verl-tokensel analyze``,
``compare``, ``view``)."""
