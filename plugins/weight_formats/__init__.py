"""Weight formats: how a model holds and multiplies its linear layers' weights (``weights=``)."""
