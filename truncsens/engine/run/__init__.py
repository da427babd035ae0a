"""The run skeleton: documents -> shards -> lock -> resume -> merge -> provenance."""
