"""`hspmd data prepare FILES... --tokenizer byte|bpe:VOCAB|PATH.json -o DIR` and `hspmd data info DIR`
(docs/data.md)."""

from __future__ import annotations

import re
import sys

__all__ = ["add_data_parser", "cmd_data", "parse_size"]

_UNITS = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "m": 1e6, "mb": 1e6, "g": 1e9, "gb": 1e9,
          "kib": 2**10, "mib": 2**20, "gib": 2**30}


def parse_size(text: str) -> int:
    """Return the bytes of a size such as `64MiB` or `100000` (SystemExit when it is not one)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text or "")
    if not m or m.group(2).lower() not in _UNITS:
        raise SystemExit(f"hspmd: error: --shard-size {text!r}: expected a size such as 64MiB or 100000")
    return max(int(float(m.group(1)) * _UNITS[m.group(2).lower()]), 1)


def add_data_parser(sub) -> None:
    """Add the `data` subcommand (prepare, info) to `hspmd`'s subparsers."""
    d = sub.add_parser("data", help="prepare a token dataset from text files, or inspect one (docs/data.md)")
    actions = d.add_subparsers(dest="data_command", required=True)
    p = actions.add_parser("prepare", help="tokenize text files into a dataset of token shards")
    p.add_argument("files", nargs="+", metavar="FILE", help="text files (.jsonl: one document per line's 'text')")
    p.add_argument("--tokenizer", required=True, metavar="byte|bpe:VOCAB|PATH.json",
                   help="byte (UTF-8 bytes, 257 ids), bpe:VOCAB (a byte-level BPE trained on the files), or a "
                        "tokenizer.json")
    p.add_argument("-o", "--output", required=True, metavar="DIR", help="the dataset directory to write (new or empty)")
    p.add_argument("--split", choices=("file", "blank", "line"), default="file",
                   help="documents of a text file: the whole file (default), each blank-line paragraph, each line")
    p.add_argument("--text-key", default="text", help="the field of a .jsonl line that holds its text (default: text)")
    p.add_argument("--shard-size", default="64MiB", metavar="SIZE", help="text per shard (default 64MiB)")
    p.add_argument("-j", "--jobs", type=int, help="threads writing shards (default: the CPUs)")
    p.set_defaults(func=cmd_data)
    i = actions.add_parser("info", help="documents, tokens, shards, vocabulary and checksums of a dataset")
    i.add_argument("path", metavar="DIR")
    i.add_argument("--no-verify", action="store_true", help="skip reading every shard to check its checksum")
    i.set_defaults(func=cmd_data)


def cmd_data(args) -> int:
    """Run `hspmd data prepare` or `hspmd data info`; DataError for a user's mistake (said by main)."""
    if args.data_command == "prepare":
        from hspmd.data.prepare import prepare

        if args.jobs is not None and args.jobs < 1:
            raise SystemExit("hspmd: error: --jobs must be at least 1")
        index = prepare(args.files, args.tokenizer, args.output, parse_size(args.shard_size), args.jobs,
                        args.split, args.text_key)
        print(f"{args.output}: {index.documents} documents, {index.tokens} tokens in {len(index.shards)} "
              f"shard{'s' if len(index.shards) != 1 else ''} ({index.dtype}), vocabulary {index.vocab_size} "
              f"({index.tokenizer})")
        return 0
    from hspmd.data.info import dataset_info

    sys.stdout.write(dataset_info(args.path, verify=not args.no_verify))
    return 0
