"""EAGLE-3 draft head: model, draft vocabulary, training-time test, export."""
