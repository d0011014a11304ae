"""The ``s3://`` store kind: fenced state and publications in an S3-compatible bucket
(``pip install 'fenced[s3]'``). The protocol and its failure analysis: docs/s3.md."""
