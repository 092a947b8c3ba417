"""Tasks on a trained classifier: evaluate (metrics and report), predict (top-k labels) and explain (heat maps),
over one inference core (inference), with the report format (report) and every figure (plots)."""
