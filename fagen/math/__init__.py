"""The mathematics the compiler proves: the online-softmax rule and its identities, the backward rule, key ranges,
and the proof memo that keeps proven statements on disk."""
