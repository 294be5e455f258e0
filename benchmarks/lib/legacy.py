"""What a report says about results imported from before the experiment system (``store.import_legacy``)."""
from __future__ import annotations

from .store import ResultStore


def legacy_note(store: ResultStore) -> str:
    """One Markdown paragraph quoting each legacy run's command and note (empty for results run here), so a table
    whose labels meant other parameters then says so beside the numbers."""
    runs = [r for r in store.load()["runs"] if r.get("legacy")]
    return "".join(f"Imported results (command: `{r['command']}`): {r.get('note', '')}\n\n" for r in runs)
