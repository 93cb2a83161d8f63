// RUN: hspmd-opt %s | hspmd-opt | filecheck %s

// Annotated IR prints and parses back: layouts ride in the tensor types' encodings and
// print in canonical layout text (aliases inlined, device runs as ranges, `, ` between
// states: "[0, 1,2,3]: split(0)=2,dup=2" prints as "[0-3]: split(0)=2, dup=2"); partial,
// multi-axis and heterogeneous layouts; dist.reshard with layouts on its two types.

#dup = #dist.layout<"[0-3]: dup=4">
#mesh = #dist.layout<"[0, 1,2,3]: split(0)=2,dup=2">
#part = #dist.layout<"[0-3]: partial=2, dup=2">
#het = #dist.layout<"[0,1]: split(1)=2 | [2,3]: dup=2 ; hetero=split(0), shares=3:1">
builtin.module {
  func.func @train_step() {
    %w = graph.parameter "w" {init = "normal:0.02"} : tensor<4x6xf32, #dup>
    %x = graph.input "x" : tensor<8x4xf32, #mesh>
    %y = graph.matmul %x, %w : (tensor<8x4xf32, #mesh>, tensor<4x6xf32, #dup>) -> tensor<8x6xf32, #mesh>
    %t = graph.transpose %y {perm = array<i64: 1, 0>} : (tensor<8x6xf32, #mesh>) -> tensor<6x8xf32, #dist.layout<"[0-3]: split(1)=2, dup=2">>
    %g = graph.matmul %t, %x : (tensor<6x8xf32, #dist.layout<"[0-3]: split(1)=2, dup=2">>, tensor<8x4xf32, #mesh>) -> tensor<6x4xf32, #part>
    %d = dist.reshard %g : tensor<6x4xf32, #part> -> tensor<6x4xf32, #dup>
    %h = dist.reshard %y : tensor<8x6xf32, #mesh> -> tensor<8x6xf32, #het>
    graph.output "d", %d : tensor<6x4xf32, #dup>
    func.return
  }
}

// CHECK:     builtin.module {
// CHECK-NEXT:  func.func @train_step() {
// CHECK-NEXT:    %w = graph.parameter "w" {init = "normal:0.02"} : tensor<4x6xf32, #dist.layout<"[0-3]: dup=4">>
// CHECK-NEXT:    %x = graph.input "x" : tensor<8x4xf32, #dist.layout<"[0-3]: split(0)=2, dup=2">>
// CHECK-NEXT:    %y = graph.matmul %x, %w : (tensor<8x4xf32, #dist.layout<"[0-3]: split(0)=2, dup=2">>, tensor<4x6xf32, #dist.layout<"[0-3]: dup=4">>) -> tensor<8x6xf32, #dist.layout<"[0-3]: split(0)=2, dup=2">>
// CHECK-NEXT:    %t = graph.transpose %y {perm = array<i64: 1, 0>} : (tensor<8x6xf32, #dist.layout<"[0-3]: split(0)=2, dup=2">>) -> tensor<6x8xf32, #dist.layout<"[0-3]: split(1)=2, dup=2">>
// CHECK-NEXT:    %g = graph.matmul %t, %x : (tensor<6x8xf32, #dist.layout<"[0-3]: split(1)=2, dup=2">>, tensor<8x4xf32, #dist.layout<"[0-3]: split(0)=2, dup=2">>) -> tensor<6x4xf32, #dist.layout<"[0-3]: partial=2, dup=2">>
// CHECK-NEXT:    %d = dist.reshard %g : tensor<6x4xf32, #dist.layout<"[0-3]: partial=2, dup=2">> -> tensor<6x4xf32, #dist.layout<"[0-3]: dup=4">>
// CHECK-NEXT:    %h = dist.reshard %y : tensor<8x6xf32, #dist.layout<"[0-3]: split(0)=2, dup=2">> -> tensor<8x6xf32, #dist.layout<"[0,1]: split(1)=2 | [2,3]: dup=2 ; hetero=split(0), shares=3:1">>
// CHECK-NEXT:    graph.output "d", %d : tensor<6x4xf32, #dist.layout<"[0-3]: dup=4">>
// CHECK-NEXT:    func.return
// CHECK-NEXT:  }
// CHECK-NEXT:}
