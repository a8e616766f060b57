"""The mathematics the compiler proves: the online-softmax rule and its identities, and key ranges."""
