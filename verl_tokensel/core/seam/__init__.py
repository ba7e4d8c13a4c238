"""The rule seam: what a token rule is (:mod:`.rule`), what it may ask of the pipeline (:mod:`.hidden`: passes over
the last hidden states; :mod:`.vocab`: per-token reductions over the vocabulary; :mod:`.pool`: exact operations
over the ranks), the advantage shapings (:mod:`.shaping`) and
the one validation pass of a resolved rule (:mod:`.checks`). Pure torch, no verl import; it imports no rule. Rule
authors reach it through :mod:`verl_tokensel.rules`."""
