"""The per-token field names the selection reads from (and writes into) verl's batches: one home for all of them.

verl's names for what its drivers attach to every response (``old_log_probs``, ``advantages``, ...), the names of
the two fields the selection adds when it is measured before the update (the mask and the scores it was ranked by),
and which of them each consumer reads. :func:`verl_tokensel.core.ranking.batch.score_batch` takes a mapping keyed by
these names. Pure strings, no import.
"""

RESPONSE_MASK = "response_mask"
#: the policy being trained (the engine's ``model_output`` key; absent = on-policy, the old pass's values)
LOG_PROBS = "log_probs"
OLD_LOG_PROBS = "old_log_probs"
ADVANTAGES = "advantages"
#: the old-log-prob pass's entropy as the V1 driver stores it with the batch (also the engine's output key)
ENTROPY = "entropy"
SUM_PI_SQUARED = "sum_pi_squared"
ROLLOUT_IS_WEIGHTS = "rollout_is_weights"
#: the rollout engine's log-probs of the sampled tokens (the behaviour policy; present with
#: ``rollout.calculate_log_probs=True``; in bypass mode verl's ``old_log_probs`` are these)
ROLLOUT_LOG_PROBS = "rollout_log_probs"
REF_LOG_PROB = "ref_log_prob"
#: an exact ``||e_a - p||`` (the analysis scorer measures it), not a verl field
LOGIT_GRAD_NORM = "logit_grad_norm"
#: verl's prompt id of each response (non-tensor)
UID = "uid"
#: verl's response token ids and per-token rewards (the reward manager's scores, less any KL-in-reward penalty)
RESPONSES = "responses"
TOKEN_LEVEL_REWARDS = "token_level_rewards"
#: the V1 driver's reward scores in TransferQueue (its token_level_rewards unless use_kl_in_reward writes those)
RM_SCORES = "rm_scores"

#: per-token fields the driver fills for a score that names them in ``needs_external`` (a rule computed where the
#: whole prompt group is): the response's token ids (int64), its outcome reward (``token_level_rewards`` summed over
#: the response) on each of its tokens, and whether the token is the tokenizer's ``eos_token_id``
RESPONSE_IDS = "response_ids"
SEQUENCE_REWARD = "sequence_reward"
EOS_TOKEN = "eos_token"
#: the external fields read from the batch's token ids and rewards (the reference model's ``ref_entropy`` aside)
RESPONSE_EXTERNAL = (RESPONSE_IDS, SEQUENCE_REWARD, EOS_TOKEN)

#: the selection's own per-token fields, laid out like ``response_mask``: the bool mask the loss applies and the
#: float32 scores it was ranked by (NaN on dropped tokens), written by the driver (score_source=rollout) or the
#: pre-pass (score_source=prepass)
MASK = "token_select_mask"
SCORE = "token_select_score"
#: the per-token values of a rule's passes over the last hidden states (``Needs(hidden_states=...)``), laid out like
#: ``response_mask``, written before the update; and the row index those passes give each response of the batch
HIDDEN = "tokensel_hidden_values"
ROW = "tokensel_row"
#: prefix of the per-token vocabulary reductions a rule declares (``Needs(vocab=...)``): ``<prefix><VocabStat.key>``
VOCAB_PREFIX = "tokensel_vocab_"
#: the non-tensor key the drivers set on each update pass of a rule with several (its ``update_passes``)
UPDATE_PASS = "tokensel_update_pass"

#: per-token inputs of verl's policy loss that every update batch carries, and those it may carry
LOSS_INPUTS = (RESPONSE_MASK, OLD_LOG_PROBS, ADVANTAGES)
OPTIONAL_LOSS_INPUTS = (ROLLOUT_IS_WEIGHTS, REF_LOG_PROB)
#: the padded per-token fields a driver-side selection reads from the whole batch
DRIVER_INPUTS = (*LOSS_INPUTS, ENTROPY, *OPTIONAL_LOSS_INPUTS, SUM_PI_SQUARED)
#: the inputs a token's loss is undefined without: a non-finite value drops the token (out of the pool, no loss)
FINITE_INPUTS = (LOG_PROBS, OLD_LOG_PROBS, ADVANTAGES, ROLLOUT_IS_WEIGHTS, REF_LOG_PROB, ENTROPY)
