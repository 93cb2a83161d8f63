// RUN: hspmd-opt %s -p 'apply-annotations' | filecheck %s

// hs.annotate's op becomes a reshard to the layout its spec means on the strategy's mesh
// (dp major, tp minor); a whole layout is kept as written.

builtin.module attributes {dist.strategies = [#dist.strategy<id = 0, "[0-3]: dp=2 tp=2", microbatches = 1, schedule = "gpipe">]} {
  func.func @train_step() {
    %x = graph.input "x" : tensor<8x16xf32>
    %a = dist.annotate %x {spec = ["dp", "tp"]} : tensor<8x16xf32> -> tensor<8x16xf32>
    %b = dist.annotate %a {spec = ["", "dp"]} : tensor<8x16xf32> -> tensor<8x16xf32>
    %c = dist.annotate %b {spec = [], layout = #dist.layout<"[0-3]: split(0)=4">} : tensor<8x16xf32> -> tensor<8x16xf32>
    graph.output "c", %c : tensor<8x16xf32>
    func.return
  }
}

// CHECK:      %a = dist.reshard %x : tensor<8x16xf32> -> tensor<8x16xf32, #dist.layout<"[0-3]: split(0)=2, split(1)=2">>
// CHECK-NEXT: %b = dist.reshard %a : tensor<8x16xf32, #dist.layout<"[0-3]: split(0)=2, split(1)=2">> -> tensor<8x16xf32, #dist.layout<"[0-3]: split(1)=2, dup=2">>
// CHECK-NEXT: %c = dist.reshard %b : tensor<8x16xf32, #dist.layout<"[0-3]: split(1)=2, dup=2">> -> tensor<8x16xf32, #dist.layout<"[0-3]: split(0)=4">>
// CHECK-NOT:  dist.annotate
