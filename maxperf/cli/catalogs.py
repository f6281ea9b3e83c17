"""The catalogs: `maxperf models`, `maxperf topologies`, `maxperf keys`. None of them starts jax."""

from __future__ import annotations

from maxperf.cli.common import GIB, JSON_HELP, print_json
from maxperf.spec import keys, presets
from maxperf.spec import topology as topologies

KEYS_SCHEMA = "maxperf.keys/1"


def cmd_models(args) -> int:
    from maxperf.perfmodel import count_params  # loads numpy, which `topologies` and `keys` do without

    rows = []
    for name in presets.names():
        m = presets.get(name)
        counts = count_params(m)
        rows.append({"name": name, "params": counts.total, "active_params": counts.active, "V": m.vocab_size,
                     "D": m.d_model, "N": m.num_layers, "H": m.num_heads, "K": m.num_kv_heads, "Dh": m.head_dim,
                     "F": m.d_ff, "E": m.num_experts, "top_k": m.num_experts_per_tok,
                     "activation": m.activation.value, "attention_type": m.attention_type.value})
    if args.json:
        print_json(rows)
        return 0
    print(f"{'model':<24} {'params':>9} {'active':>9} {'V':>7} {'D':>6} {'N':>4} {'H':>4} {'K':>4} {'Dh':>4} {'F':>7} "
          f"{'E':>4} {'k':>2}  attention_type")
    for r in rows:
        print(f"{r['name']:<24} {_billions(r['params']):>9} {_billions(r['active_params']):>9} {r['V']:>7} {r['D']:>6} "
              f"{r['N']:>4} {r['H']:>4} {r['K']:>4} {r['Dh']:>4} {r['F']:>7} {r['E']:>4} {r['top_k']:>2}  "
              f"{r['attention_type']}")
    return 0


def _billions(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e7 else f"{n / 1e6:.3f}M"


def cmd_topologies(args) -> int:
    from maxperf.aot.compiler import device_memory_bytes

    rows = [t for t in topologies.catalog() if args.platform in (None, t.platform)]
    if args.json:
        # a CPU device holds its share of this host's memory, as compile and run count it (and the text says)
        print_json([t.as_dict() | ({"hbm_bytes_per_chip": device_memory_bytes(t),
                                    "hbm_bytes_per_device": device_memory_bytes(t)} if t.platform == "cpu" else {})
                    for t in rows])
        return 0
    print(f"{'topology':<16} {'platform':<8} {'chips':>6} {'hosts':>6} {'HBM/chip':>10} {'bf16 TFLOP/s':>13}  layout")

    for t in rows:
        # a CPU device holds its share of this host's memory, as compile and run count it; its peak is what
        # `maxperf calibrate` measures
        memory = (device_memory_bytes(t) if t.platform == "cpu" else t.hbm_bytes_per_chip)
        hbm = f"{memory / GIB:.2f} GiB" if memory else "-"
        peak = (f"{t.peak_bf16_flops_per_chip / 1e12:.0f}" if t.peak_bf16_flops_per_chip and t.platform != "cpu"
                else "-")
        layout = t.libtpu_topology or t.gpu_target or ""
        print(f"{t.name:<16} {t.platform:<8} {t.chips:>6} {t.hosts:>6} {hbm:>10} {peak:>13}  {layout}")
    print("cpu-N: N devices of this process (any N), each with its share of this host's memory; their peak is "
          "what `maxperf calibrate` measures")
    return 0


def cmd_keys(args) -> int:
    described = keys.describe()
    if args.json:
        print_json({"schema": KEYS_SCHEMA, "keys": [k.as_dict() for k in described]})
        return 0
    print(f"{'key':<36} {'config':<11} {'type':<14} {'default':<10} {'bound':>9}  meaning (MaxText's spellings)")
    for k in described:
        default = k.default.value if hasattr(k.default, "value") else k.default
        kind = k.type if len(k.type) <= 14 else "choice"
        bound = "" if k.bound is None else f"{k.bound:.4g}"
        extra = f" ({', '.join(k.maxtext)})" if k.maxtext else ""
        print(f"{k.name:<36} {k.config:<11} {kind:<14} {str(default):<10} {bound:>9}  {k.meaning}{extra}"
              + (f"; one of {k.type.replace('|', ', ')}" if kind == "choice" else ""))
    return 0


def add_parsers(sub) -> None:
    p = sub.add_parser("models", help="list the model presets")
    p.add_argument("--json", action="store_true", help=JSON_HELP)
    p.set_defaults(func=cmd_models)

    p = sub.add_parser("topologies", help="list the topologies maxperf compiles for")
    p.add_argument("--json", action="store_true", help=JSON_HELP)
    p.add_argument("--platform", choices=["tpu", "gpu", "cpu"], help="only this platform's topologies")
    p.set_defaults(func=cmd_topologies)

    p = sub.add_parser("keys", help="list the key=value override keys: type, default, bound, meaning, MaxText aliases")
    p.add_argument("--json", action="store_true", help=JSON_HELP)
    p.set_defaults(func=cmd_keys)
