"""Beyond weights: interventions (one-head swaps) and faithfulness of token-importance measures."""
