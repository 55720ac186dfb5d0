"""The training runtime (torch). Receives the Plan (or its JSON) and builds exactly
the groups the plan printed; never re-derives the layout."""
