"""Each host phase's excess in ours' engines over plain V2's, per
concurrency, from this folder's side_by_side.json: the mean over ours' three
engines of each engine's median ms per step, over plain V2's, less 1. Run
here: python3 phase_excess.py (writes phase_excess.json)."""
import json, statistics as st
r = json.load(open("side_by_side.json"))
out = {"what": "ours' engines' mean of each engine's median ms per step over plain V2's, less 1, per host phase",
       "command": "python3 phase_excess.py (README)", "by_concurrency": {}}
for c, e in r["by_concurrency"].items():
    runs = e["runs"]
    def mean(arms, k):
        return st.fmean(st.median(x["phases"][k]["ms_per_step"] for x in runs[a]) for a in arms)
    out["by_concurrency"][c] = {
        k: round(mean(["ours_served", "ours_served_twin", "ours_served_twin2"], k)
                 / mean(["nospec", "nospec_twin", "nospec_twin2"], k) - 1, 4)
        for k in ("schedule", "execute_model", "sample_tokens", "update_from_output")}
json.dump(out, open("phase_excess.json", "w"), indent=1)
print(json.dumps(out["by_concurrency"]))
