module interop

go 1.21

require github.com/apache/thrift v0.17.0
