"""Analysis: a text through a model, window by window, into results and tables."""
