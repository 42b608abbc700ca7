"""`specserve bench one-batch | ...`."""

from __future__ import annotations

from specserve.bench.args import CHECKS, positive_int


def _checked_first(parser, check) -> None:
    """Run `check(args)` before the command's own function (which loads models)."""
    run = parser.get_default("func")

    def run_checked(args):
        check(args)
        return run(args)

    parser.set_defaults(func=run_checked)


def add_bench_parser(sub, add_engine_args, engine_kwargs) -> None:
    bench = sub.add_parser("bench", help="benchmarks (print JSON and a table)")
    bsub = bench.add_subparsers(dest="bench_command", required=True)

    from specserve.bench.acceptance import add_acceptance_parser
    from specserve.bench.serving import add_serving_parser

    add_serving_parser(bsub)
    add_acceptance_parser(bsub)

    from specserve.bench.compare import add_compare_parser
    from specserve.bench.e2e import add_e2e_parser

    add_compare_parser(bsub)
    add_e2e_parser(bsub)

    from specserve.bench.profile_step import add_profile_parser

    add_profile_parser(bsub, add_engine_args, engine_kwargs)

    from specserve.bench.multiturn import add_multiturn_parser

    add_multiturn_parser(bsub, add_engine_args, engine_kwargs)

    ob = bsub.add_parser("one-batch", help="static batch: prefill and decode throughput")
    ob.add_argument("--batch-size", type=positive_int, nargs="+", default=[1])
    ob.add_argument("--input-len", type=positive_int, default=128)
    ob.add_argument("--output-len", type=positive_int, default=256)
    ob.add_argument("--output-json", help="also write the rows to this file")
    ob.add_argument(
        "--repeats",
        type=positive_int,
        default=1,
        help="timed runs per batch size; the row is the median by decode throughput",
    )
    ob.add_argument(
        "--chat",
        action="store_true",
        help="the packaged held-out and bench prompts as chats (needs a tokenizer) instead "
        "of random ids: a real draft's acceptance",
    )
    add_engine_args(ob)

    def run_one_batch_cmd(args):
        from specserve.bench.one_batch import check_static_batches, dump, run_one_batch
        from specserve.engine import Engine
        from specserve.errors import InvalidArgument

        rows = []
        kwargs = engine_kwargs(args)
        # one static batch: every request of the largest batch runs at once (SGLang's
        # bench_one_batch sizes its engine so too); a user's limit is checked instead
        kwargs.setdefault("max_running_requests", max(args.batch_size))
        with Engine(**kwargs) as engine:
            if args.chat and engine.tokenizer is None:
                raise InvalidArgument(
                    "--chat", "the chat prompts need a tokenizer; this model has none"
                )
            check_static_batches(
                engine, args.batch_size, args.input_len, args.output_len, chat=args.chat
            )
            for bs in args.batch_size:
                rows.append(
                    run_one_batch(
                        engine,
                        bs,
                        args.input_len,
                        args.output_len,
                        chat=args.chat,
                        repeats=args.repeats,
                    )
                )
        dump(rows, args.output_json)
        return 0

    ob.set_defaults(func=run_one_batch_cmd)
    for name, check in CHECKS.items():
        _checked_first(bsub.choices[name], check)
