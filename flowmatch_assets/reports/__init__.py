"""Budget, data card, caption-following evaluation and its analyser: no Dagster."""
