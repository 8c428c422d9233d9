"""The trust path: the pure code that decides what the model is trained on.

No I/O, no Kafka, HTTP, gRPC or process wiring: the services call it with what they received
and send on what it returns. Read it in this order (ARCHITECTURE.md, "Trust path", says the
guarantee each module keeps):

    contract    what every engine call must ask for: exact ids, log-probs, neutral sampling
    capture     an engine answer or a finished stream -> the harness call's ModelCalls
    calls       the merging view of a recorded call
    tree        the calls of an episode as a tree: which call extends which
    breaks      where a call's prompt departs from what came before, and why
    merging     calls -> chains (segments) with their loss masks and the token books
    group       a group's episodes and their events, as they arrive
    advantages  rewards of a group -> one advantage per episode
    feedback    a production session's signals -> its reward and its turns' rewards
    session_baseline  a session's reward against the running estimate before it
    samples     a group -> GroupSamples, deterministically, with its token books
    session_samples   a production session -> GroupSamples the same way
    canary      a candidate version promoted or rolled back on the sessions' evidence
    batching    groups -> the next batch; what is stale is decided here, once
    packing     a batch -> micro-batches, and each token's normalisation weight
    loss        the clipped policy-gradient loss, KL and entropy over a micro-batch
    step        one optimiser step over a batch
"""
