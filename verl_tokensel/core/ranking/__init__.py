"""The ranking machinery: the per-token fields of a batch and its score inputs (:mod:`.batch`), the registered scores
(:mod:`.scores`), the scopes and budgets (:mod:`.scopes`), the selection over a pool (:mod:`.select`) and its exact
distributed top-k (:mod:`.dist_topk`). Pure torch, no verl import; it knows no rule."""
